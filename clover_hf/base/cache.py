"""The KV cache: how a forward takes it, and its compaction to the accepted tree nodes after a verification forward.

Two kinds: a `DynamicCache`, whose tensors grow by concatenation and are cut by slicing, and transformers'
`StaticCache`, preallocated to a fixed number of slots (`capacity`) and written in place at its
`cumulative_length`, which compaction moves back instead of cropping: its tensors keep their addresses,
as a compiled forward (and CUDA graphs) need.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import weakref

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from clover_hf import cpu


class _CutView:
    """A growing layer's keys or values: cut from its store when read after `set_length` (see there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, layer, owner: type | None = None) -> torch.Tensor | None:
        if layer is None:
            return self
        if layer._length is not None:
            layer._cut()
        return getattr(layer, self.slot)

    def __set__(self, layer, tensor: torch.Tensor | None) -> None:
        if layer._length is not None:
            layer._cut()
        setattr(layer, self.slot, tensor)


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are views of larger tensors (its stores), which new tokens are written
    into in place: `DynamicLayer` concatenates, copying the whole layer at every forward, a cost that grows with
    the context and soon outweighs the update itself.
    A store holds a quarter more slots than it needs, at least SPARE; where the keys are no longer a view of it (a
    caller replaced them) or it is full, the next update copies them into a new one. Outside inference mode the
    stores made in it (a decoding call's) are copied first, as inference tensors cannot be written there."""

    SPARE = 128
    _length: int | None = None  # where set_length left the keys and values the stores' first slots, not yet cut
    _key_layout: cpu.KeyLayout | None = None  # the kernel's layout of the key store (`key_layout`)

    keys = _CutView()
    values = _CutView()

    def _cut(self) -> None:
        end, self._length = self._length, None
        self._keys, self._values = self._views = (self.stores[0].narrow(2, 0, end), self.stores[1].narrow(2, 0, end))

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.stores: tuple[torch.Tensor, torch.Tensor] | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # the keys and values this layer last set
        self._inference = False  # whether the stores are inference tensors

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        key_store, value_store = self._room(end, key_states, value_states)
        key_store.narrow(2, length, end - length).copy_(key_states)
        value_store.narrow(2, length, end - length).copy_(value_states)
        if self._key_layout is not None:
            self._key_layout.written(length)
        self.set_length(end)
        return self.keys, self.values

    def key_layout(self) -> cpu.KeyLayout | None:
        """The kernel's layout of the key store's keys (`cpu.KeyLayout`), made for the stores as they are;
        None where the layer holds no stores."""
        if self.stores is None:
            return None
        self._key_layout = cpu.KeyLayout.of(self.stores[0], self._key_layout)
        return self._key_layout

    def reserve(self, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stores, holding the keys and values so far and room for `end` slots, for a caller that writes the new
        slots itself (then calls `set_length(end)`); None where the layer holds no keys yet."""
        if not self.is_initialized or (self._length is None and self.keys.dim() != 4):
            return None
        return self._room(end, self._keys, self._values)

    def reserve_after(self, length: int, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`reserve(end)` where this layer holds `length` slots, else None. Its common case (the length this layer set
        itself, room left) in a few reads: forwards ask it of every layer, and `reserve`'s calls, once per layer, add
        up to a visible share of a step."""
        stores = self.stores if self._length == length else None
        if stores is not None and end <= stores[0].shape[-2] and (
                not self._inference or torch.is_inference_mode_enabled()):
            return stores
        return self.reserve(end) if self.get_seq_length() == length else None

    def _room(self, end: int, key_like: torch.Tensor, value_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The stores, made anew (holding the keys and values so far) where they are not views of them, lack room
        for `end` slots or may not be written here; new ones are shaped and typed as `key_like`, `value_like`."""
        # views this layer set itself need no check of where they lie
        if (not self.holds_views() or end > self.stores[0].shape[-2]
                or (self._inference and not torch.is_inference_mode_enabled())) and not self._writable(end):
            self.stores = (self._store(self.keys, key_like, end), self._store(self.values, value_like, end))
            self._inference = self.stores[0].is_inference()
        return self.stores

    def extend(self, layer: cpu.DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               weights: list, mask: torch.Tensor | None, causal: bool = False) -> torch.Tensor | None:
        """`layer`'s output for x (`cpu.DecoderLayer`), its keys and values for x written into the stores in
        place after those held; None (nothing done) where this holds no keys yet or the kernel does not take the
        inputs."""
        length = self.get_seq_length()
        stores = self.reserve(length + x.shape[1]) if x.dim() == 3 else None
        out = None if stores is None else layer(x, cos, sin, weights, *stores, length, mask, self.key_layout(), causal)
        if out is not None:
            self.set_length(length + x.shape[1])
        return out

    @staticmethod
    def hold(layers: list, stores: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> bool:
        """Whether each of `layers` holds `length` slots in the `stores` given for it (as `reserve_after` returned
        them, which it would again while they have room): a forward's every layer asks, and every layer's
        `reserve_after` and kernel pointers add up to a visible share of a verify forward."""
        return all(layer._length == length and layer.stores is held for layer, held in zip(layers, stores))

    def set_length(self, end: int) -> None:
        """Keys and values cut to the stores' first `end` slots (compaction), as views made when next read: the
        kernel's forwards and compaction read the stores, and making every layer's two views each step adds up."""
        self._length = end

    def get_seq_length(self) -> int:
        return self._length if self._length is not None else super().get_seq_length()

    def holds_views(self) -> bool:
        """Whether the keys and values are the stores' first slots, as `set_length` left them."""
        views = self._views
        return self._length is not None or (views is not None and views[0] is self._keys and views[1] is self._values)

    def slot_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensors holding the keys and values at their slots: the stores, where they hold them as views."""
        return self.stores if self.holds_views() else (self.keys, self.values)

    def _writable(self, end: int) -> bool:
        """Whether the stores hold the keys and values as views and `end` slots, and may be written here."""
        if self.stores is None or (self._inference and not torch.is_inference_mode_enabled()):
            return False
        return all(t.dim() == 4 and t.data_ptr() == store.data_ptr() and t.stride() == store.stride()
                   and t.shape[:2] == store.shape[:2] and end <= store.shape[-2]
                   for t, store in zip((self.keys, self.values), self.stores))

    def _store(self, held: torch.Tensor, new: torch.Tensor, end: int) -> torch.Tensor:
        """A new store for `end` slots and spare ones, holding `held` (none where empty) at its start."""
        store = new.new_empty(*new.shape[:2], end + max(self.SPARE, end // 4), new.shape[-1])
        if held.dim() == 4 and held.shape[-2]:
            store[..., : held.shape[-2], :] = held
        return store


def new_cache() -> DynamicCache:
    """A cache of full-length layers for every layer type, each a `GrowingLayer`.

    Sliding-window layers of a config-built `DynamicCache` keep only W-1 keys and would drop prefix
    keys when a whole tree is appended; full layers plus a windowed mask give the same attention.
    """
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


@functools.lru_cache(maxsize=None)
def cache_keyword(model_class: type) -> str:
    """The keyword a model's forward takes its cache by: `cache` from transformers 5.24 (which deprecates
    `past_key_values`, to be removed), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


# the field `generate`'s output returns the cache in: renamed with the forward's keyword
OUTPUT_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)} else "past_key_values"


def given_cache(kwargs: dict):
    """The cache in `generate`'s keyword arguments (the caller's, or one `generate` prepared), under the
    keyword of transformers 5.24 (`cache`) or before (`past_key_values`); None if there is none."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def is_static(cache) -> bool:
    """Whether `cache` is preallocated and written in place (transformers' static layers)."""
    return isinstance(cache, StaticCache)


def static_cache(model, capacity: int) -> StaticCache:
    """A static cache of `capacity` slots per layer for `model`, allocated at its first forward."""
    return StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=capacity)


def capacity(cache) -> int | None:
    """The number of slots per layer of a static cache; None for a cache that grows."""
    return min(layer.max_cache_len for layer in cache.layers) if is_static(cache) else None


def static_sliding_layers(cache) -> bool:
    """Whether a static cache holds sliding-window layers, which keep only the last window of keys and
    would drop the prefix keys a tree's compaction moves."""
    return is_static(cache) and any(getattr(layer, "is_sliding", False) for layer in cache.layers)


def to_normal_tensors(cache) -> None:
    """A static cache's tensors made in inference mode, as normal tensors (copied; called outside it), so
    that it can be updated in place after the call, as plain decoding goes on with it. A dynamic cache
    only ever concatenates onto its tensors, which inference tensors allow."""
    if not is_static(cache):
        return
    for layer in _layers(cache):
        for name in ("keys", "values", "cumulative_length"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.is_inference():
                setattr(layer, name, t.clone())
                torch._dynamo.mark_static_address(getattr(layer, name))  # as transformers marks them


def _layers(cache: DynamicCache):
    return [layer for layer in cache.layers if getattr(layer, "is_initialized", True)]


def _static_layer(layer) -> bool:
    """Whether a cache layer is written in place at its `cumulative_length` (transformers' static layers)."""
    return hasattr(layer, "cumulative_length")


def _set_length(layer, end: int) -> None:
    """A layer's stored length after compaction: a static layer's write position moves back (in place, so
    its address stays fixed for compiled forwards), a dynamic layer's tensors are cut."""
    if isinstance(layer, GrowingLayer) and layer.holds_views():  # first: the common case, and cheaper to ask
        layer.set_length(end)
    elif _static_layer(layer):
        layer.cumulative_length.fill_(end)
    else:
        layer.keys = layer.keys.narrow(-2, 0, end)
        layer.values = layer.values.narrow(-2, 0, end)


def _replace(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Give a layer new key and value tensors (fewer rows or slots). A static layer keeps its size: the
    new ones are written at its first slots, or, with fewer rows, into fresh tensors of its size."""
    if not _static_layer(layer):
        layer.keys, layer.values = keys, values
        return
    if keys.shape[0] != layer.keys.shape[0]:
        shape = (keys.shape[0], *layer.keys.shape[1:])
        layer.keys, layer.values = layer.keys.new_zeros(shape), layer.values.new_zeros(shape[:-1] + values.shape[-1:])
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(layer.keys)
            torch._dynamo.mark_static_address(layer.values)
    layer.keys[..., : keys.shape[-2], :] = keys
    layer.values[..., : values.shape[-2], :] = values
    layer.cumulative_length.fill_(keys.shape[-2])


def _gather_slots(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """t (B, heads, T, d) at the key positions index (B, C) of each row. One row reads them by `index_select`,
    without gather's index per element, which makes it the faster of the two."""
    index = index.to(t.device)  # layers of a model split over devices live apart
    if t.shape[0] == 1:
        return t.index_select(-2, index[0])
    return t.gather(-2, index[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[-1]))


def _in_place(keep: torch.Tensor) -> int:
    """How many leading entries every row keeps where they are (offset i at i): those need no move.

    The root is always kept at offset 0, and a step that accepts the first drafted node keeps offset
    1 too, so often nothing moves. Read on the CPU only: elsewhere the moves are queued without
    waiting, and reading the offsets would be a host sync.
    """
    if keep.device.type != "cpu":
        return 0
    rows, same = keep.tolist(), 0  # on the host: a step's offsets are a few, fewer than torch's ops would cost
    while same < keep.shape[1] and all(row[same] == same for row in rows):
        same += 1
    return same


def compact_cache(cache: DynamicCache, prefix_len: int, keep: torch.Tensor) -> None:
    """Move the kept tree entries to the prefix end and drop the rest.

    keep: (B, K) offsets into the block after `prefix_len`, per row. A row that keeps fewer than K
    entries pads its list with any offset; the caller masks those slots out (position -1).
    """
    end = prefix_len + keep.shape[1]
    start = _in_place(keep)
    moved = keep.shape[1] - start
    src = keep[:, start:] + prefix_len
    layers = _layers(cache)
    if moved:  # a growing layer's stores hold its slots: reading its keys would make views only for this
        pairs = [layer.slot_tensors() if isinstance(layer, GrowingLayer) else (layer.keys, layer.values)
                 for layer in layers]
        if not _slot_mover(cache, pairs)(src, prefix_len + start):
            for keys, values in pairs:
                for t in (keys, values):
                    t.narrow(-2, prefix_len + start, moved).copy_(_gather_slots(t, src))
    for layer in layers:
        _set_length(layer, end)


def _slot_mover(cache, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
    """`cpu.SlotMover` over the keys and values `pairs` of the cache's layers: the cache's last one where its
    layers hold the same tensors (a growing layer's stores until they grow), else a new one; a mover that moves
    nothing where the kernel does not take them."""
    made = _SLOT_MOVERS.get(cache)
    if made is not None and len(made[0]) == len(pairs) and all(a is b for a, b in zip(made[0], pairs)):
        return made[1]
    mover = cpu.SlotMover.of([t for pair in pairs for t in pair]) or _no_move
    _SLOT_MOVERS[cache] = (pairs, mover)
    return mover


def _no_move(src: torch.Tensor, dst: int) -> bool:
    return False


_SLOT_MOVERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> (its layers' pairs, their mover)


def select_rows(cache: DynamicCache, rows: torch.Tensor, columns: torch.Tensor | None = None) -> None:
    """Keep only the given batch rows (and, when given, the given key positions, as indices or a bool
    mask) of every layer."""
    if columns is not None and columns.dtype == torch.bool:
        columns = columns.nonzero().squeeze(1)  # one host sync here, not one per layer as a mask index costs
    for layer in _layers(cache):
        keep = rows.to(layer.keys.device)
        keys, values = layer.keys[keep], layer.values[keep]
        if columns is not None:
            used = columns.to(layer.keys.device)
            keys, values = keys[..., used, :], values[..., used, :]
        elif _static_layer(layer):  # a static layer's slots past its length hold nothing
            length = int(layer.cumulative_length)
            keys, values = keys[..., :length, :], values[..., :length, :]
        _replace(layer, keys, values)


def select_slots(cache: DynamicCache, index: torch.Tensor) -> None:
    """Keep, per row, the key positions in `index` (B, C), in that order. Keys carry their rotary
    position already and every mask is built from explicit positions, so slots may move freely."""
    for layer in _layers(cache):
        _replace(layer, _gather_slots(layer.keys, index), _gather_slots(layer.values, index))
