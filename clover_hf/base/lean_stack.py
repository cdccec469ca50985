"""A decoder layer of the Llama pattern in one call of the C kernel, and all of a model's layers in one.

Where every part of a layer has a kernel call of its own (`lean_layers.LeanForward`), every product computes from
the kernel's tiled copies (`cpu.layer_weights`) and the cache grows in place (`cache.GrowingLayer`), the whole layer
is one call of those same functions (`cpu.DecoderLayer`, bitwise them one by one); where all of a model's layers run
so, the first layer's forward runs them all in one call (`cpu.DecoderStack`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from clover_hf import cpu
from clover_hf.cpu import BlockMemo, layer_weights

from .cache import GrowingLayer


class _WholeLayer:
    """A decoder layer in one `cpu.DecoderLayer` call, as a function of (hidden states, mask, position
    embeddings, cache) that returns None (nothing done) where a call is not one it computes: its products not all
    in the kernel's tiled copies (`cpu.layer_weights`: q/k/v and gate/up stacked), or a cache that is not a
    growing one holding keys."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        norm_in, post = layer.input_layernorm, layer.post_attention_layernorm
        head_dim = attn.head_dim
        self.kernel = cpu.DecoderLayer(norm_in.weight, post.weight, float(norm_in.variance_epsilon),
                                       attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim,
                                       head_dim, attn.scaling)
        self.projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                            mlp.down_proj)
        self.layer_idx = attn.layer_idx

    def weights(self, rows: int) -> list | None:
        return layer_weights(rows, *self.projections)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None, embeddings: tuple, cache) -> torch.Tensor | None:
        if getattr(cache, "offloading", False) or self.layer_idx >= len(getattr(cache, "layers", ())):
            return None
        stored = cache.layers[self.layer_idx]
        weights = self.weights(x.numel() // x.shape[-1]) if isinstance(stored, GrowingLayer) else None
        return None if weights is None else stored.extend(self.kernel, x, *embeddings, weights, mask)


class _Held(NamedTuple):
    """The cache stores a `_Stack`'s kernels were last pointed at."""

    layers: list  # the cache's layers
    stores: list[tuple[torch.Tensor, torch.Tensor]]  # each one's keys and values stores
    slots: int  # the fewest slots of those
    batch: int
    pointed: int  # `cpu.DecoderLayer.pointed` then
    inference: bool  # whether any store is an inference tensor (written in inference mode only)


class _Segments:
    """Decoder layers as one `cpu.DecoderStack` call per segment, cut after each tapped layer (heads that read
    several layers' outputs, `CloverConfig.feature_layers`): each tapped layer's output is kept (`tapped`)."""

    def __init__(self, kernels: list, taps: tuple[int, ...]) -> None:
        ends = sorted({t + 1 for t in taps} | {len(kernels)})
        self.stacks = [cpu.DecoderStack(kernels[start:end]) for start, end in zip([0, *ends], ends)]
        self.ends, self.taps = ends, taps
        self.tapped: dict[int, torch.Tensor] = {}  # layer index -> its output in the last call

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, length: int, mask: torch.Tensor | None
                 ) -> torch.Tensor | None:
        """The last layer's output, as `cpu.DecoderStack`'s; None where the inputs are not of its form (every segment
        takes the same, so none ran)."""
        self.tapped = {}
        for stack, end in zip(self.stacks, self.ends):
            x = stack(x, cos, sin, length, mask)
            if x is None:
                return None
            self.tapped[end - 1] = x
        return x


class _Stack:
    """All of a model's decoder layers in one `cpu.DecoderStack` call, made by the first layer's forward where
    each layer would run whole (`_WholeLayer`): the layers after it then hand on what they are given, the stack's
    output (`out`). Per layer, Python's calls cost a sizeable share of a whole layer's time. With `taps`, one call per
    segment cut after each tapped layer, whose output that layer returns (`hand_on`), so hooks read it."""

    def __init__(self, taps: tuple[int, ...] = ()) -> None:
        self.taps = taps
        self.wholes: list[_WholeLayer | None] = []
        self.stack: cpu.DecoderStack | _Segments | None = None
        self.key: tuple | None = None  # (form, or rows past the steady ones; the first q projection's forward, a
        # `cpu.BoundLinear`) the weights were last set for
        self.memo = BlockMemo()  # the layers' weights by rows
        self.out: torch.Tensor | None = None
        self.held: _Held | None = None  # the stores the kernels were last pointed at

    def add(self, whole: _WholeLayer | None) -> None:
        self.wholes.append(whole)

    def ready(self, layers: list[nn.Module]) -> None:
        """Run as one where the layers added are the model's `layers`, in order, each whole."""
        if self.wholes and len(self.wholes) == len(layers) and all(
                w is not None and w.layer_idx == i for i, w in enumerate(self.wholes)):
            kernels = [w.kernel for w in self.wholes]
            taps = tuple(t % len(kernels) for t in self.taps)
            self.stack = _Segments(kernels, taps) if taps else cpu.DecoderStack(kernels)

    @property
    def tapped(self) -> list[torch.Tensor]:
        """The tapped layers' outputs in the last call, in the order of `taps` (none without taps)."""
        if not isinstance(self.stack, _Segments) or self.out is None:
            return []
        return [self.stack.tapped[t] for t in self.stack.taps]

    def hand_on(self, hidden: torch.Tensor, layer_idx: int) -> torch.Tensor | None:
        """What a later layer returns where the first ran them all in this forward (it is given what the layer before
        it returned): a tapped layer's own output, else the stack's; None where the stack did not run."""
        if self.out is None:
            return None
        outputs = self.stack.tapped if isinstance(self.stack, _Segments) else {}
        if hidden is not self.out and not any(hidden is t for t in outputs.values()):
            return None
        return outputs.get(layer_idx, self.out)

    def _weights(self, rows: int) -> list | None:
        """Each layer's tiled weights for `rows` rows, or None where any computes otherwise."""
        weights = [whole.weights(rows) for whole in self.wholes]
        return None if any(w is None for w in weights) else weights

    def _holding(self, stored: list, length: int, end: int, batch: int) -> bool:
        """Whether the kernels point at the stores the cache's layers hold `length` slots in, with room for `end`: as
        they were pointed at last, no kernel pointed elsewhere since, where they may be written (`reserve_after`)."""
        held = self.held
        return (held is not None and end <= held.slots and batch == held.batch
                and held.pointed == cpu.DecoderLayer.pointed and stored[: len(held.layers)] == held.layers
                and (not held.inference or torch.is_inference_mode_enabled())
                and GrowingLayer.hold(held.layers, held.stores, length))

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None, embeddings: tuple, cache) -> torch.Tensor | None:
        """The last layer's output (kept as `out`), or None (nothing done: the layers compute one by one)."""
        self.out = None
        stored = getattr(cache, "layers", ())
        if self.stack is None or getattr(cache, "offloading", False) or len(stored) < len(self.wholes) or x.dim() != 3:
            return None
        rows, tokens = x.numel() // x.shape[-1], x.shape[1]
        forward = self.wholes[0].projections[0].forward  # a new block of linear forms binds a new `cpu.BoundLinear`
        # the row counts of a form compute from the same weights (`BlockMemo`): a width of the form last set needs none
        form = BlockMemo.steady_form(forward, rows)
        key = (rows if form is None else form, forward)
        if key != self.key:
            self.key = None
            weights = self.memo.get(forward, rows, self._weights)
            if weights is None or not all(whole.kernel.set_weights(w) for whole, w in zip(self.wholes, weights)):
                return None
            self.key = key
        length = stored[0].get_seq_length()
        end = length + tokens
        if not self._holding(stored, length, end, x.shape[0]):
            self.held = None
            held = []
            for whole, layer in zip(self.wholes, stored):
                stores = layer.reserve_after(length, end) if isinstance(layer, GrowingLayer) else None
                if stores is None or not whole.kernel.set_stores(*stores, x.shape[0], end, layer.key_layout()):
                    return None
                held.append(stores)
            self.held = _Held(stored[: len(self.wholes)], held, min(keys.shape[-2] for keys, _ in held), x.shape[0],
                              cpu.DecoderLayer.pointed, any(keys.is_inference() for keys, _ in held))
        self.out = self.stack(x, *embeddings, length, mask)
        if self.out is not None:
            for layer in stored[: len(self.wholes)]:
                layer.set_length(length + tokens)
        return self.out
