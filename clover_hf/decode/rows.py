"""The rows of one generate call: each sequence's decode state, and the base cache the rows share.

Rows advance at their own pace: each keeps its own accepted nodes in the shared cache, where the
slots other rows use are masked, and a finished row leaves the batch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from clover_hf.base.cache import capacity, compact_cache, select_rows, select_slots
from clover_hf.base.forward import MaskLayout
from clover_hf.heads.augment import AugmentCache

from .budget import CATCH_UP_STEPS
from .lookup import NgramIndex
from .verification import sample_token

REPACK_UNUSED_SHARE = 0.5  # a batch's cache is repacked once more than this share of its slots is masked


@dataclass
class Emitter:
    """Appends a step's tokens, honouring stopping criteria (called token by token where it cannot read them
    itself), the streamer and output scores."""

    input_ids: torch.Tensor
    stopping_criteria: StoppingCriteriaList
    streamer: object | None
    scores: list[torch.Tensor] | None
    raw_logits: list[torch.Tensor] | None
    _known: tuple | None = field(default=None, init=False, repr=False)  # `_known_criteria`, read at the first emit

    def emit(self, tokens: torch.Tensor, scores: torch.Tensor | None, logits: torch.Tensor | None) -> tuple[int, bool]:
        """Append tokens (n,) whose processed scores/raw logits are (n, V); return (appended, finished). Both may be
        None where this keeps neither and its criteria do not read scores (`criteria_read_scores`)."""
        stop = self._stop_within(tokens)
        if stop is None:
            stop = self._stop_called(tokens, scores)
        n = stop or tokens.shape[0]
        self.input_ids = torch.cat([self.input_ids, tokens[:n].view(1, n)], dim=1)
        for i in range(n):
            if self.scores is not None:
                self.scores.append(scores[i : i + 1])
            if self.raw_logits is not None:
                self.raw_logits.append(logits[i : i + 1])
        self._stream(tokens[:n])
        return n, stop > 0

    def _stop_called(self, tokens: torch.Tensor, scores: torch.Tensor) -> int:
        """As `_stop_within`, by calling the criteria on the text with each of `tokens` appended in turn."""
        for i in range(tokens.shape[0]):
            text = torch.cat([self.input_ids, tokens[: i + 1].view(1, i + 1)], dim=1)
            if bool(self.stopping_criteria(text, None if scores is None else scores[i : i + 1]).any()):
                return i + 1
        return 0

    def _stop_within(self, tokens: torch.Tensor) -> int | None:
        """Where the stopping criteria are all transformers' max-length and end-of-sequence ones, read here: how
        many of `tokens` to append, the last of which stops the text (0: none stops it). None: the criteria are
        called token by token (others, or past the model's position limit, where max-length warns), which costs
        a visible share of a step for every token."""
        if self._known is None:
            self._known = _known_criteria(self.stopping_criteria)
        if not self._known:
            return None
        eos, max_length, positions = self._known
        length, ids = self.input_ids.shape[1], tokens.tolist()
        if positions is not None and length + len(ids) > positions:
            return None
        for i, token in enumerate(ids):
            if token in eos or length + i + 1 >= max_length:
                return i + 1
        return 0

    def _stream(self, tokens: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())


def criteria_read_scores(criteria: StoppingCriteriaList) -> bool:
    """Whether stopping `criteria` may read the scores they are called with: any but transformers' max-length and
    end-of-sequence ones."""
    return not _known_criteria(criteria)


def _known_criteria(criteria: StoppingCriteriaList) -> tuple[set[int], float, int | None] | tuple[()]:
    """(end-of-sequence ids, max length, the model's position limit) where `criteria` are only transformers'
    `EosTokenCriteria` and `MaxLengthCriteria`; else ()."""
    eos, max_length, positions = set(), float("inf"), None
    for criterion in criteria:
        if type(criterion) is EosTokenCriteria:
            eos.update(torch.as_tensor(criterion.eos_token_id).flatten().tolist())
        elif type(criterion) is MaxLengthCriteria:
            max_length = min(max_length, criterion.max_length)
            limit = criterion.max_position_embeddings
            if limit is not None:
                positions = limit if positions is None else min(positions, limit)
        else:
            return ()
    return eos, max_length, positions


@dataclass
class Row:
    """One sequence's decode state. The rows of a batch share the base's cache and its forwards."""

    emitter: Emitter
    start: int  # first column of its text after the left padding
    root: torch.Tensor  # () the token after the cached text: chosen, not yet in the cache
    next_pos: torch.Tensor  # () the root's position
    chain_len: int  # prompt-lookup chain length of the next step
    finished: bool
    ngrams: NgramIndex | None = None  # its text's n-grams, for the lookup chain
    feature: torch.Tensor | None = None  # (H,) the heads' features at the last position they have seen
    aug_cache: AugmentCache | None = None
    # (hidden, next-token embeddings, positions), each (1, T, ...), of the last steps' positions the heads have not
    # seen yet: after a long pause the Augmenting Block catches up on the last CATCH_UP_STEPS steps only
    pending: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=lambda: deque(maxlen=CATCH_UP_STEPS))


def start_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor,
               logits: torch.Tensor, hidden: torch.Tensor, logits_processor: LogitsProcessorList, sample: bool,
               stopping_criteria: StoppingCriteriaList, streamer: object | None, keep: tuple[bool, bool], lookup: int,
               embed) -> list[Row]:
    """Each row's first token, chosen from the prefill's last logits and emitted, and its decode state;
    `keep`: whether to keep (scores, logits) for the output."""
    scores = logits_processor(input_ids, logits[:, -1])
    rows = []
    for b in range(input_ids.shape[0]):
        root = sample_token(scores[b].softmax(-1), torch.rand((), device=input_ids.device)) if sample else scores[b].argmax()
        emitter = Emitter(input_ids[b : b + 1], stopping_criteria, streamer,
                          [] if keep[0] else None, [] if keep[1] else None)
        _, finished = emitter.emit(root.view(1), scores[b : b + 1], logits[b, -1:])
        valid = positions[b] >= 0
        start = 0 if attention_mask is None else int(valid.long().argmax())
        row = Row(emitter, start, root, positions[b].max() + 1, lookup, finished)
        if not finished:
            row.ngrams = NgramIndex(emitter.input_ids[0, start:].tolist())
            cols = slice(None) if attention_mask is None else valid
            text = torch.cat([input_ids[b, cols][1:], root.view(1)])
            row.pending.append((hidden[b, cols][None], embed(text)[None], positions[b, cols][None]))
        rows.append(row)
    return rows


@dataclass
class Batch:
    """The rows decoding together over one base cache. `positions` (active rows, slots) is each active
    row's position per cache slot, -1 where the slot is not its own (padding, other rows' nodes)."""

    rows: list[Row]  # every row, in input order
    cache: DynamicCache
    positions: torch.Tensor
    layout: MaskLayout
    plain_mask: bool  # one unpadded row without a window: one-token steps keep the base's own mask path
    active: list[Row] = field(init=False)

    def __post_init__(self) -> None:
        self.active = list(self.rows)
        self.drop_finished()

    def attention(self, node_pos: torch.Tensor, allowed: torch.Tensor, dtype: torch.dtype):
        """The `attention_mask` of a forward of the rows' nodes at `node_pos` (B, N) that see each other
        where `allowed` (B, N, N) says, over the cache."""
        if self.plain_mask and node_pos.shape[1] == 1:
            return torch.ones(1, self.positions.shape[1] + 1, dtype=torch.long, device=node_pos.device)
        if self.plain_mask:  # every cached key is the row's own: only the tree's part is blocked (the mask
            # `layout.build` makes, in half its ops, which are a visible share of a drafted step)
            past, tokens = self.positions.shape[1], node_pos.shape[1]
            mask = torch.zeros(1, 1, tokens, past + tokens, dtype=dtype, device=node_pos.device)
            mask[0, 0, :, past:].masked_fill_(~allowed[0], torch.finfo(dtype).min)
            return mask
        return self.layout.build(self.positions, node_pos, allowed, dtype, slots=capacity(self.cache))

    def room(self) -> int | None:
        """How many tokens per row the next forward may write: a static cache's free slots (None: no limit)."""
        slots = capacity(self.cache)
        return None if slots is None else slots - self.positions.shape[1]

    def keep(self, kept: list[torch.Tensor], node_pos: torch.Tensor) -> None:
        """After a forward of nodes at `node_pos`, keep each row's `kept` nodes in the cache, drop the rest."""
        self.positions = torch.cat([self.positions, _compact(self.cache, self.positions.shape[1], kept, node_pos)], dim=1)
        if len(self.active) > 1:
            self.positions = _repack(self.cache, self.positions)

    def drop_finished(self) -> None:
        """Finished rows leave the cache, and so do the slots no remaining row uses."""
        alive = [b for b, row in enumerate(self.active) if not row.finished]
        if alive and len(alive) < len(self.active):  # when all are done the cache is returned as is
            keep = torch.tensor(alive, device=self.positions.device)
            positions = self.positions[keep]
            used = (positions >= 0).any(dim=0)
            select_rows(self.cache, keep, used)
            self.positions = positions[:, used]
        self.active = [self.active[b] for b in alive]


def _repack(cache, positions: torch.Tensor) -> torch.Tensor:
    """Move each row's used slots to the end of the cache once masked slots dominate it.

    Rows of a batch keep different numbers of tree nodes per step, so each step leaves masked slots
    in the rows that kept fewer; without repacking they would cost memory and attention for good.
    """
    used = positions >= 0
    if (~used).sum() <= REPACK_UNUSED_SHARE * used.numel():  # one host sync per batched step
        return positions
    width = int(used.sum(dim=1).max())
    index = used.int().argsort(dim=1, stable=True)[:, -width:]  # masked slots first, then used ones in order
    select_slots(cache, index)
    return positions.gather(1, index)


def _compact(cache, past_len: int, kept: list[torch.Tensor], node_pos: torch.Tensor) -> torch.Tensor:
    """Keep each row's accepted nodes in the cache; returns the (B, K) positions of the kept slots (-1: unused)."""
    if len(kept) == 1:
        if kept[0].shape[0] < node_pos.shape[1]:  # else every verified node was kept, in place
            compact_cache(cache, past_len, kept[0][None])
        return node_pos.index_select(1, kept[0])
    width = max(k.shape[0] for k in kept)
    index = torch.zeros(len(kept), width, dtype=torch.long, device=node_pos.device)
    slot_pos = torch.full_like(index, -1)
    for b, k in enumerate(kept):
        index[b, : k.shape[0]] = k
        slot_pos[b, : k.shape[0]] = node_pos[b, k]
    compact_cache(cache, past_len, index)
    return slot_pos


def pad_id(generation_config: GenerationConfig) -> torch.Tensor | int | None:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    return generation_config.pad_token_id if pad is None else pad


def sequences(rows: list[Row], generation_config: GenerationConfig) -> torch.Tensor:
    """(B, L) sequences; rows that stopped early end in `pad_token_id`, as in transformers' own decoding."""
    texts = [row.emitter.input_ids[0] for row in rows]
    length = max(t.shape[0] for t in texts)
    if all(t.shape[0] == length for t in texts):
        return torch.stack(texts)
    pad = torch.as_tensor(pad_id(generation_config), device=texts[0].device)  # checked before decoding
    out = pad.to(texts[0].dtype).expand(len(texts), length).clone()
    for b, t in enumerate(texts):
        out[b, : t.shape[0]] = t
    return out
