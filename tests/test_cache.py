"""Cache compaction moves each row's kept tree entries behind its prefix; finished rows leave."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from clover_hf.base.cache import GrowingLayer, compact_cache, new_cache, select_rows

KINDS = [pytest.param(DynamicCache, id="concatenating"), pytest.param(new_cache, id="growing")]


@pytest.fixture(params=KINDS)
def kind(request):
    return request.param


def _cache(batch: int, length: int, kind=DynamicCache) -> DynamicCache:
    cache = kind()
    for layer in range(2):
        # (B, heads, T, head_dim) whose entries name their row, layer and slot
        keys = torch.arange(batch * length, dtype=torch.float32).view(batch, 1, length, 1).expand(-1, 2, -1, 3)
        cache.update(keys.clone() + 1000 * layer, -keys.clone(), layer)
    return cache


def test_compact_cache_keeps_each_rows_own_nodes(kind):
    cache = _cache(batch=2, length=9, kind=kind)  # a 4-slot prefix, then a 5-node tree block
    keep = torch.tensor([[0, 2, 3], [0, 4, 0]])  # row 1 keeps two nodes and pads with slot 0
    compact_cache(cache, 4, keep)
    for layer, offset in zip(cache.layers, (0, 1000)):
        assert layer.keys.shape == (2, 2, 7, 3)
        row0, row1 = layer.keys[0, 0, :, 0].tolist(), layer.keys[1, 0, :, 0].tolist()
        assert row0 == [offset + v for v in [0, 1, 2, 3, 4, 6, 7]]
        assert row1[:6] == [offset + v for v in [9, 10, 11, 12, 13, 17]]
        assert torch.equal(layer.values, -(layer.keys - offset))


def test_select_rows_drops_rows_and_unused_slots(kind):
    cache = _cache(batch=3, length=4, kind=kind)
    select_rows(cache, torch.tensor([0, 2]), torch.tensor([True, False, True, True]))
    keys = cache.layers[0].keys
    assert keys.shape == (2, 2, 3, 3)
    assert keys[:, 0, :, 0].tolist() == [[0, 2, 3], [8, 10, 11]]


def test_select_slots_gathers_per_row():
    from clover_hf.base.cache import select_slots

    cache = _cache(batch=2, length=5)
    select_slots(cache, torch.tensor([[1, 3], [4, 0]]))
    assert cache.layers[1].keys[:, 0, :, 0].tolist() == [[1001, 1003], [1009, 1005]]
    assert cache.layers[1].values[:, 0, :, 0].tolist() == [[-1, -3], [-9, -5]]


def test_compact_cache_moves_only_what_is_out_of_place(monkeypatch):
    import clover_hf.base.cache as cache_module
    from clover_hf.cpu.kernel_library import KERNEL

    assert cache_module._in_place(torch.tensor([[0, 1, 4]])) == 2
    assert cache_module._in_place(torch.tensor([[0, 2, 3], [0, 4, 0]])) == 1  # every row must agree
    assert cache_module._in_place(torch.tensor([[0, 1]])) == 2
    moved = []
    gather = cache_module._gather_slots
    monkeypatch.setattr(cache_module, "_gather_slots", lambda t, index: moved.append(index.tolist()) or gather(t, index))
    monkeypatch.setattr(KERNEL, "lib", None)  # torch's moves (the kernel's: tested below)
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


def _step(cache, start: int, count: int, batch: int = 2) -> None:
    """`count` new slots in each of two layers whose keys name their position (from `start`) and layer, values the
    negative."""
    for layer in range(2):
        keys = torch.arange(start, start + count, dtype=torch.float32).view(1, 1, count, 1).expand(batch, 2, -1, 3)
        cache.update(keys + 1000 * layer, -(keys + 1000 * layer), layer)


def _positions(layer) -> list[float]:
    assert torch.equal(layer.values, -layer.keys)
    return layer.keys[0, 0, :, 0].tolist()


def test_a_growing_cache_writes_new_slots_in_place_and_copies_only_when_full():
    cache = new_cache()
    _step(cache, 0, 5)
    layer = cache.layers[0]
    assert isinstance(layer, GrowingLayer)
    store = layer.stores[0]
    assert store.shape[-2] == 5 + GrowingLayer.SPARE and layer.keys.data_ptr() == store.data_ptr()
    for start in range(5, 5 + GrowingLayer.SPARE, 16):
        _step(cache, start, 16)
        assert layer.stores[0] is store  # written in place, no copy of what it holds
    assert _positions(layer) == list(range(5 + GrowingLayer.SPARE))
    _step(cache, 5 + GrowingLayer.SPARE, 3)  # full: copied once into a store a quarter larger or SPARE more
    assert layer.stores[0] is not store and _positions(layer) == list(range(8 + GrowingLayer.SPARE))
    assert [_positions(layer)[-1] for layer in cache.layers] == [7 + GrowingLayer.SPARE, 1007 + GrowingLayer.SPARE]


def test_a_growing_cache_goes_on_in_place_after_compaction_and_copies_after_replacement():
    cache = new_cache()
    _step(cache, 0, 6)
    store = cache.layers[0].stores[0]
    compact_cache(cache, 2, torch.tensor([[0, 3], [0, 3]]))  # keeps slots 2 and 5 behind the prefix
    _step(cache, 10, 2)
    assert cache.layers[0].stores[0] is store and _positions(cache.layers[0]) == [0, 1, 2, 5, 10, 11]
    select_rows(cache, torch.tensor([1]))  # new tensors: no longer views of the store
    _step(cache, 20, 1, batch=1)
    assert cache.layers[0].stores[0] is not store and cache.layers[0].keys.shape[0] == 1
    assert _positions(cache.layers[1]) == [1000, 1001, 1002, 1005, 1010, 1011, 1020]


def test_a_growing_layers_cut_keys_are_made_when_read(monkeypatch):
    """`set_length` only records the length (the kernel's forwards and compaction read the stores): its length is
    reported at once, and the keys and values read later are the stores' first slots, also where one is replaced
    before the other is read; compaction moves slots in the stores without making the views."""
    cache = new_cache()
    _step(cache, 0, 8)
    layer = cache.layers[0]
    cuts = []
    real_narrow = torch.Tensor.narrow

    def narrow(t, *args):
        if args[:2] == (2, 0):  # a view of a store's first slots (moves narrow to others)
            cuts.append(args)
        return real_narrow(t, *args)

    monkeypatch.setattr(torch.Tensor, "narrow", narrow)
    layer.set_length(6)
    compact_cache(cache, 2, torch.tensor([[0, 3], [0, 2]]))  # slots 2, 5 (row 0) and 2, 4 (row 1) behind the prefix
    assert layer.get_seq_length() == 4 and cache.get_seq_length() == 4 and not cuts
    monkeypatch.setattr(torch.Tensor, "narrow", real_narrow)
    keys = layer.keys
    assert keys.shape[-2] == 4 and keys.data_ptr() == layer.stores[0].data_ptr()
    assert _positions(layer) == [0, 1, 2, 5] and layer.values[1, 0, :, 0].tolist() == [0, -1, -2, -4]
    layer.set_length(3)
    layer.keys, layer.values = layer.keys[:1], layer.values[:1]  # a caller's own (the values were cut first)
    assert layer.keys.shape[:3] == layer.values.shape[:3] == (1, 2, 3) and not layer.holds_views()
    assert _positions(layer) == [0, 1, 2]


def test_a_growing_cache_made_in_inference_mode_goes_on_outside_it():
    """A decoding call's cache holds inference tensors; a caller may go on decoding with it outside inference mode
    (plain `generate` runs under no_grad), where those cannot be written: the stores are copied first."""
    cache = new_cache()
    with torch.inference_mode():
        _step(cache, 0, 4)
    assert cache.layers[0].stores[0].is_inference()
    with torch.no_grad():
        _step(cache, 4, 2)
    assert not cache.layers[0].stores[0].is_inference()
    assert _positions(cache.layers[0]) == list(range(6))


def test_reserving_after_a_length_is_reserving_where_the_layer_holds_that_length():
    """`reserve_after(length, end)` is `reserve(end)` where the layer holds `length` slots and None elsewhere: after
    its own writes and `set_length` (its quick case), after its keys were read, when its stores are full, after a
    caller replaced its keys, and with inference stores outside inference mode (copied first, as `reserve` does)."""
    cache = new_cache()
    layer = cache.layers[0] if cache.layers else None
    assert layer is None or layer.reserve_after(0, 4) is None
    with torch.inference_mode():
        _step(cache, 0, 6)
    layer = cache.layers[0]
    capacity, stores = layer.stores[0].shape[-2], layer.stores
    for quick in (False, True):  # the length read from the keys, then the one set_length recorded
        if quick:
            layer.set_length(6)
        with torch.inference_mode():
            assert layer.reserve_after(5, 8) is None and layer.reserve_after(7, 8) is None
            assert layer.reserve_after(6, 8) is stores
    with torch.inference_mode():
        assert layer.keys.shape[-2] == 6 and layer.reserve_after(6, 9) is stores  # keys read: views cut
        layer.set_length(6)
        grown = layer.reserve_after(6, capacity + 1)  # full: a larger copy, holding what it held
        assert grown is not stores and grown[0].shape[-2] > capacity and _positions(layer) == list(range(6))
    with torch.no_grad():  # inference stores outside inference mode: copied, as `reserve` copies them
        layer.set_length(6)
        written = layer.reserve_after(6, 8)
        assert not written[0].is_inference() and _positions(layer) == list(range(6))
    layer.keys, layer.values = layer.keys[:, :, :4], layer.values[:, :, :4]  # a caller's own
    assert layer.reserve_after(6, 8) is None and layer.reserve_after(4, 6)[0].shape[-2] >= 6
    assert _positions(layer) == list(range(4))


def test_compaction_in_the_kernel_moves_what_torch_moves(monkeypatch):
    """Where the kernel is loaded, compaction moves every layer's slots in one call: the kept slots hold what torch's
    gathers put there (a padded slot, masked out, may hold another), for rows that keep different nodes, float32 and
    bf16, growing and concatenated layers; and never where it is not loaded."""
    from clover_hf.cpu import kernel as bf16_kernel
    from clover_hf.cpu.kernel_library import KERNEL, _compiler

    if not bf16_kernel.cpu_supports() or _compiler() is None or not bf16_kernel.available():
        pytest.skip("no kernel on this CPU")
    moved = []
    real, library = bf16_kernel.SlotMover.__call__, KERNEL.lib

    def move(mover, *args):
        moved.append(real(mover, *args))
        return moved[-1]

    monkeypatch.setattr(bf16_kernel.SlotMover, "__call__", move)
    keep = torch.tensor([[0, 2, 3, 5], [1, 4, 0, 0]])
    for dtype in (torch.float32, torch.bfloat16):
        for kind in (DynamicCache, new_cache):
            caches = {}
            for loaded in (True, False):
                monkeypatch.setattr(KERNEL, "lib", library if loaded else None)
                cache = caches[loaded] = _cache(batch=2, length=12, kind=kind)
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys.to(dtype), layer.values.to(dtype)
                    if kind is new_cache:
                        layer.stores = (layer.keys, layer.values)
                compact_cache(cache, 5, keep)
            for ours, torchs in zip(caches[True].layers, caches[False].layers):
                assert ours.keys.shape == (2, 2, 9, 3)
                for t, u in ((ours.keys, torchs.keys), (ours.values, torchs.values)):  # row 1's last two: padding
                    assert torch.equal(t[0], u[0]) and torch.equal(t[1, :, :7], u[1, :, :7])
    assert moved == [True] * 4  # (never made where the kernel is not loaded)


def test_compaction_keeps_the_kernels_pointers_while_the_stores_hold_and_reads_them_again_after_they_grow(
        monkeypatch):
    """A growing cache's compactions move slots through one `SlotMover` while its layers hold the same stores; once
    they grow (new tensors) or a caller replaces a layer's keys, a new one reads the new tensors' addresses, and the
    kept slots hold what they should (moves through the old pointers would have written the old stores)."""
    from clover_hf.cpu import kernel as bf16_kernel
    from clover_hf.cpu.kernel_library import _compiler

    if not bf16_kernel.cpu_supports() or _compiler() is None or not bf16_kernel.available():
        pytest.skip("no kernel on this CPU")
    made = []
    real = bf16_kernel.SlotMover.of.__func__
    monkeypatch.setattr(bf16_kernel.SlotMover, "of",
                        classmethod(lambda cls, tensors: made.append(real(cls, tensors)) or made[-1]))
    cache = new_cache()
    _step(cache, 0, 4)
    expected, grown, stores = [0.0, 1.0, 2.0, 3.0], 0, cache.layers[0].stores
    for step in range(100):  # a verify step of 6 nodes, keeping the root and two more
        start = 10_000 + 10 * step
        _step(cache, start, 6)
        compact_cache(cache, len(expected), torch.tensor([[0, 2, 5]] * 2))
        expected += [start, start + 2, start + 5]
        assert _positions(cache.layers[0]) == expected
        assert _positions(cache.layers[1]) == [1000 + v for v in expected]
        grown += cache.layers[0].stores is not stores
        stores = cache.layers[0].stores
    assert grown >= 2 and len(made) == grown + 1 and None not in made
    layer = cache.layers[1]
    layer.keys, layer.values = layer.keys.clone(), layer.values.clone()  # a caller's own: no longer the stores
    for step in range(2):
        start = 20_000 + 10 * step
        _step(cache, start, 6)
        compact_cache(cache, len(expected), torch.tensor([[0, 4]] * 2))
        expected += [start, start + 4]
        assert _positions(cache.layers[0]) == expected and _positions(layer) == [1000 + v for v in expected]
