"""What identifies a tensor's contents, for caches of what is made from weights: kept while the tensors are
the same objects with the same storage and in-place version."""

from __future__ import annotations

import weakref

import torch

from .quantized import plain


def watch(t: torch.Tensor | None) -> tuple | None:
    """What identifies a tensor's contents for a cache: the tensor (weakly), its storage and in-place version."""
    if t is None:
        return None
    storage = t.data_ptr() if plain(t) else None  # a quantized tensor subclass may have no storage of its own
    return weakref.ref(t), storage, t.dtype, t.device, None if t.is_inference() else t._version


def unchanged(watched: list[tuple | None], tensors: list[torch.Tensor | None]) -> bool:
    """Whether `tensors` are those `watch` saw, their contents unchanged."""
    for w, t in zip(watched, tensors):
        if (w is None) != (t is None) or (t is not None and (w[0]() is not t or w[1:] != watch(t)[1:])):
            return False
    return True
