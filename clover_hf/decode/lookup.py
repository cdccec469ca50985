"""Prompt lookup: draft tokens by matching the text's last n-gram against earlier text.

Clover can hang such a chain below the root of its tree: where the output copies from the prompt or
repeats itself the chain runs past the heads' depth, and the one verify forward checks both.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable

import torch


class NgramIndex:
    """Where each n-gram (n = 1..max_ngram) of a growing text occurs with a token after it.

    Decoding extends it by the tokens each step accepts, so finding the step's chain costs a
    dictionary lookup per n, not a scan of the whole text.
    """

    def __init__(self, ids: Iterable[int], max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self.ids: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its start positions, ascending
        self.extend(ids)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the text: the n-grams just before each now have a token after them."""
        for token in tokens:
            end = len(self.ids)
            self.ids.append(token)
            for n in range(1, min(self.max_ngram, end) + 1):
                self.starts.setdefault(tuple(self.ids[end - n : end]), []).append(end - n)

    def match(self, num_tokens: int) -> tuple[int, int]:
        """(start, n): the text's last n tokens occurred earlier, followed by the tokens from `start`.

        Takes the longest n with a match; among its matches, the most recent one with `num_tokens`
        tokens after it, else the earliest. (len(text), 0) when nothing matches.
        """
        length = len(self.ids)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            starts = self.starts.get(tuple(self.ids[length - n :]))
            if starts:
                full = bisect_right(starts, length - n - num_tokens)  # how many have num_tokens after them
                return (starts[full - 1] if full else starts[0]) + n, n
        return length, 0


def lookup_continuation(ids: torch.Tensor, num_tokens: int, max_ngram: int = 3) -> torch.Tensor:
    """Up to `num_tokens` tokens that followed an earlier occurrence of the last n tokens of `ids`
    (see `NgramIndex.match`); empty when nothing matches. ids: (L,) token ids, the newest last."""
    start, _ = NgramIndex(ids.tolist(), max_ngram).match(num_tokens)
    return ids[start : start + num_tokens]
