"""Cache compaction moves each row's kept tree entries behind its prefix; finished rows leave."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from clover_hf.cache import compact_cache, select_rows


def _cache(batch: int, length: int) -> DynamicCache:
    cache = DynamicCache()
    for layer in range(2):
        # (B, heads, T, head_dim) whose entries name their row, layer and slot
        keys = torch.arange(batch * length, dtype=torch.float32).view(batch, 1, length, 1).expand(-1, 2, -1, 3)
        cache.update(keys.clone() + 1000 * layer, -keys.clone(), layer)
    return cache


def test_compact_cache_keeps_each_rows_own_nodes():
    cache = _cache(batch=2, length=9)  # a 4-slot prefix, then a 5-node tree block
    keep = torch.tensor([[0, 2, 3], [0, 4, 0]])  # row 1 keeps two nodes and pads with slot 0
    compact_cache(cache, 4, keep)
    for layer, offset in zip(cache.layers, (0, 1000)):
        assert layer.keys.shape == (2, 2, 7, 3)
        row0, row1 = layer.keys[0, 0, :, 0].tolist(), layer.keys[1, 0, :, 0].tolist()
        assert row0 == [offset + v for v in [0, 1, 2, 3, 4, 6, 7]]
        assert row1[:6] == [offset + v for v in [9, 10, 11, 12, 13, 17]]
        assert torch.equal(layer.values, -(layer.keys - offset))


def test_select_rows_drops_rows_and_unused_slots():
    cache = _cache(batch=3, length=4)
    select_rows(cache, torch.tensor([0, 2]), torch.tensor([True, False, True, True]))
    keys = cache.layers[0].keys
    assert keys.shape == (2, 2, 3, 3)
    assert keys[:, 0, :, 0].tolist() == [[0, 2, 3], [8, 10, 11]]


def test_select_slots_gathers_per_row():
    from clover_hf.cache import select_slots

    cache = _cache(batch=2, length=5)
    select_slots(cache, torch.tensor([[1, 3], [4, 0]]))
    assert cache.layers[1].keys[:, 0, :, 0].tolist() == [[1001, 1003], [1009, 1005]]
    assert cache.layers[1].values[:, 0, :, 0].tolist() == [[-1, -3], [-9, -5]]


def test_compact_cache_moves_only_what_is_out_of_place(monkeypatch):
    import clover_hf.cache as cache_module

    assert cache_module._in_place(torch.tensor([[0, 1, 4]])) == 2
    assert cache_module._in_place(torch.tensor([[0, 2, 3], [0, 4, 0]])) == 1  # every row must agree
    assert cache_module._in_place(torch.tensor([[0, 1]])) == 2
    moved = []
    gather = cache_module._gather_slots
    monkeypatch.setattr(cache_module, "_gather_slots", lambda t, index: moved.append(index.tolist()) or gather(t, index))
    # the root and the first drafted node stay at offsets 0 and 1; only offset 4 moves, to offset 2
    cache = _cache(batch=1, length=9)
    compact_cache(cache, 4, torch.tensor([[0, 1, 4]]))
    assert moved == [[[8]]] * 4  # keys and values of both layers, one slot each
    for layer, offset in zip(cache.layers, (0, 1000)):
        assert layer.keys[0, 0, :, 0].tolist() == [offset + v for v in [0, 1, 2, 3, 4, 5, 8]]
        assert torch.equal(layer.values, -(layer.keys - offset))
    # nothing out of place: nothing moves and the block is cut after the kept entries
    moved.clear()
    cut = _cache(batch=1, length=9)
    compact_cache(cut, 4, torch.tensor([[0, 1]]))
    assert moved == []
    assert cut.layers[1].keys[0, 0, :, 0].tolist() == [1000 + v for v in range(6)]
