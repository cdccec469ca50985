"""What every kind of draft heads shares (`DraftHeads`): the config, the draft vocabulary and its lm_head rows,
how the heads embed tokens; and the packed examples' ids the training pass masks by (`document_ids`).

The heads never hold vocabulary-sized weights: token embeddings and the lm_head come from the base
model at run time and are passed in explicitly (`embed`, and the lm_head rows as a `DraftLMHead`).
"""

from __future__ import annotations

import torch
from torch import nn

from clover_hf.core.quantized import dense, plain
from clover_hf.core.watch import unchanged, watch

from .config import CloverConfig
from .lm_head import DraftLMHead, LMHeadEmbedding


class DraftHeads(nn.Module):
    """What every kind of draft heads shares: the config, the draft vocabulary and its lm_head rows.

    Subclasses provide `features` (per accepted position, with an optional cache), `forward` (the
    teacher-forced training pass) and `draft` (a static tree's tokens), so training and the decoding
    loop serve them all; those with `dynamic_trees` also draft EAGLE-2-style trees (`draft_dynamic`).
    """

    dynamic_trees = False

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        if config.draft_vocab_size is not None:
            # Which base-vocabulary ids the heads draft from; filled by training (most frequent tokens).
            self.register_buffer("draft_token_ids", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_token_ids = None
        self._lm_head_rows: tuple[list, DraftLMHead] | None = None  # (sources, rows)

    @property
    def taps(self) -> tuple[int, ...]:
        """The base's decoder layers whose outputs the heads read besides the last hidden state (`feature_layers`)."""
        return tuple(self.config.feature_layers or ())

    def draft_lm_head(self, lm_head: nn.Module) -> DraftLMHead:
        """The base lm_head restricted to the draft vocabulary (all rows without one), in the base's dtype.

        A quantized lm_head (torchao's, bitsandbytes') is dequantized into the rows. The rows are built
        once and kept until the lm_head or the draft vocabulary changes.
        """
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.draft_token_ids is None and plain(weight):
            return DraftLMHead(weight, bias)
        sources = [weight, bias, self.draft_token_ids]
        memo = self._lm_head_rows
        if memo is None or not unchanged(memo[0], sources):
            with torch.inference_mode(False):  # kept past the call that builds them (decoding runs in inference mode)
                ids = slice(None) if self.draft_token_ids is None else self.draft_token_ids.to(weight.device)
                rows, bias = dense(weight).detach()[ids], None if bias is None else bias.detach()[ids]
            self._lm_head_rows = ([watch(t) for t in sources], DraftLMHead(rows, bias))
        return self._lm_head_rows[1]

    def token_embedding(self, base_model: nn.Module) -> nn.Module:
        """How the heads embed tokens (the drafted ones, and those that follow each accepted position): the
        base's input embeddings, or with `embed_from_lm_head` its lm_head's rows."""
        if self.config.embed_from_lm_head:
            return LMHeadEmbedding(base_model.get_output_embeddings())
        return base_model.get_input_embeddings()

    def init_from_base(self, base_model: nn.Module, norms: bool = False) -> bool:
        """Copy what fits from the base into fresh heads; returns whether anything was copied."""
        return False

    def upgrade_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weights saved by an earlier release, renamed to this release's layout (here: as they are)."""
        return state

    def init_projections(self, lm_head: nn.Module) -> None:
        """Start projections of their own from the base's lm_head rows (once the draft vocabulary is chosen)."""

    def head_logits(self, i: int, hidden: torch.Tensor, lm_head: DraftLMHead) -> torch.Tensor:
        """Logits over the draft vocabulary of head i's output `hidden`: through the base's lm_head rows."""
        return lm_head(hidden)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) index of the packed example each position belongs to: a new one wherever a position is 0."""
    return (position_ids == 0).cumsum(-1)
