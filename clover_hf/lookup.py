"""Prompt lookup: draft tokens by matching the text's last n-gram against earlier text.

Clover can hang such a chain below the root of its tree: where the output copies from the prompt or
repeats itself the chain runs past the heads' depth, and the one verify forward checks both.
"""

from __future__ import annotations

import torch


def lookup_continuation(ids: torch.Tensor, num_tokens: int, max_ngram: int = 3) -> torch.Tensor:
    """Up to `num_tokens` tokens that followed an earlier occurrence of the last n tokens of `ids`.

    Tries n = max_ngram down to 1 and takes the longest n with a match; among its matches, the most
    recent one with `num_tokens` tokens after it, else the earliest. Empty when nothing matches.
    ids: (L,) token ids, the newest last.
    """
    return lookup_match(ids, num_tokens, max_ngram)[0]


def lookup_match(ids: torch.Tensor, num_tokens: int, max_ngram: int = 3) -> tuple[torch.Tensor, int]:
    """`lookup_continuation`'s tokens and the length n of the n-gram that found them (0: none found).
    Longer matches are likelier to go on copying, so the draft budget weighs chains by it."""
    length = ids.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = ids[: length - 1].unfold(0, n, 1)  # every earlier n-gram with a token after it
        starts = (windows == ids[length - n :]).all(dim=-1).nonzero().flatten()
        if starts.numel() == 0:
            continue
        full = starts[starts + n + num_tokens <= length]
        start = int(full[-1] if full.numel() else starts[0]) + n
        return ids[start : start + num_tokens], n
    return ids[:0], 0
