"""KV-cache compaction: keep only the accepted tree nodes after a verification forward."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache() -> DynamicCache:
    """A cache of full-length layers for every layer type.

    Sliding-window layers of a config-built `DynamicCache` keep only W-1 keys and would drop prefix
    keys when a whole tree is appended; full layers plus a windowed mask give the same attention.
    """
    return DynamicCache()


def compact_cache(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Move the kept tree entries (offsets into the block after `prefix_len`) to the prefix end; drop the rest."""
    src = keep + prefix_len
    end = prefix_len + keep.shape[0]
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True):
            continue
        layer.keys[..., prefix_len:end, :] = layer.keys.index_select(-2, src)
        layer.values[..., prefix_len:end, :] = layer.values.index_select(-2, src)
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
