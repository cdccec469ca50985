"""The seam between the decode loop and how the base computes: a `Backend` answers the loop's few questions (a
prefill, a verify forward over a tree, a forward's width, a node's greedy choice) and learns what it needs from the
steps themselves, out of the loop's sight.

`TorchBackend` is torch's own forward, eager (the lean layers) or compiled over a static cache by transformers'
rules; `clover_hf.backends.kernel_backend.KernelBackend` adds the CPU kernel's linear forms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from clover_hf import cpu
from clover_hf.base.cache import capacity, new_cache
from clover_hf.base.forward import MaskLayout, base_forward
from clover_hf.base.lean_layers import lean_layers
from clover_hf.base.verify_forward import Verified, VerifyForward, top_k_columns

if TYPE_CHECKING:
    from clover_hf.decode.choosing import StepBudget


class TorchBackend:
    """The base's forwards in torch: `verify` (eager, or compiled per width bucket over a static cache) and the
    prefill. Nothing to learn: the step hooks only hand the budget each step's time."""

    forms: dict[int, str] = {}  # how linear layers multiply each row count (torch's own: none chosen)

    def __init__(self, model: PreTrainedModel, verify: VerifyForward, key: str | None = None) -> None:
        self.model, self.verify_forward = model, verify
        self.key = key  # the machine's key in the draft budget's costs (None: no budget)

    @property
    def compiled(self) -> bool:
        return self.verify_forward.compiled is not None

    @property
    def buckets(self) -> tuple[int, ...] | None:
        """The widths trees are padded to (None: each tree runs at its own size)."""
        return self.verify_forward.buckets

    @property
    def settled(self) -> bool:
        """Whether the last verify forward's time is the step's (not a compiling call's, nor a one-off check's)."""
        return self.verify_forward.settled

    @contextlib.contextmanager
    def bound(self) -> Iterator[None]:
        """The call's block: the decoder layers in their lean forward where it is eager."""
        with contextlib.nullcontext() if self.compiled else lean_layers(self.model, pack=self._packs(),
                                                                        taps=self.verify_forward.taps):
            yield

    def _packs(self) -> bool:
        return False

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layout: MaskLayout,
                pre_norm: bool, cache=None):
        """The prompts (B, P), left-padded where `attention_mask` says so, through the base into `cache` (an empty
        static cache) or a new dynamic one. Returns the last position's logits, the hidden states, positions (B, P)
        (-1: a masked slot), the cache, and whether decoding may keep the base's own mask path (one unpadded row
        without a window, on a dynamic cache)."""
        batch, prompt_len = input_ids.shape
        valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        positions = torch.where(valid, valid.long().cumsum(1) - 1, -1)
        # One unpadded row without a window goes through the base's own mask path, as in plain decoding: its
        # prefill builds no (P, P) mask (a long prompt's would take gigabytes), and in bf16 an explicit additive
        # mask rounds differently from the base's own at some lengths.
        plain_mask = (cache is None and batch == 1 and not layout.mapping and layout.sliding_window is None
                      and bool(valid.all()))
        cache = new_cache() if cache is None else cache
        if plain_mask:
            mask = torch.ones(1, prompt_len, dtype=torch.long, device=input_ids.device)
        else:
            eye = torch.eye(prompt_len, dtype=torch.bool, device=input_ids.device)
            causal = (eye.new_ones(prompt_len, prompt_len).tril() & valid[:, None, :]) | eye
            mask = layout.build(positions[:, :0], positions, causal, self.model.dtype, slots=capacity(cache))
        logits, hidden = base_forward(self.model, input_ids, mask, positions.clamp(min=0), cache, logits_to_keep=1,
                                      pre_norm=pre_norm, taps=self.verify_forward.taps)
        return logits, hidden, positions, cache, plain_mask

    def width(self, tokens: int, room: int | None) -> int:
        """The verify forward's width for a tree of `tokens` tokens (a compiled forward's bucket where it fits)."""
        return self.verify_forward.width(tokens, room)

    def verify(self, ids: torch.Tensor, mask, positions: torch.Tensor, cache) -> Verified:
        """The base forward of a step's trees (B, T) over the cache: logits (or greedy choices, or a top-k cut's
        columns, where the forward gives those) and the hidden states the heads read."""
        return self.verify_forward(ids, mask, positions, cache)

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        """Each node's greedy choice from its scores (T, V)."""
        return scores.argmax(-1)

    def top_k_columns(self, scores: torch.Tensor, k: int, marked: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A top-k cut of float32 scores (R, n): each row's k-th largest and, ascending, the columns some row keeps or
        `marked` names (None: a score is a NaN). The CPU kernel's selection where it is built (it serves any
        backend's float32 scores), else torch's."""
        made = cpu.top_k_columns(scores, k, marked)
        return made if made is not None else top_k_columns(scores, k, marked)

    def forms_settled(self) -> bool:
        """Whether the call's steps already cost what they will (nothing left to learn)."""
        return True

    def learning(self) -> bool:
        """Whether this step still learns how this machine multiplies (it then costs more than it will)."""
        return False

    def before_step(self, budget: StepBudget | None) -> None:
        """Before a step drafts: what the budget may verify this step, where the backend has something to learn."""

    def after_step(self, budget: StepBudget | None, rows: int, width: int, started: float, emitted: int) -> None:
        """After a step: the budget learns its cost (`rows` x `width` tokens verified since `started`)."""
        if budget is not None:
            budget.verified(rows, width, started, self.settled)

    def finish(self) -> None:
        """After the call: keep what was learnt."""
