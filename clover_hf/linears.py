"""How linear layers multiply the few rows of a verify step, chosen by what is faster on the CPU at hand.

A verify forward multiplies a handful of rows (the tree's tokens) by every weight, a shape BLAS
libraries serve unevenly. On an AVX2-only AMD EPYC in fp32, `F.linear` (x @ W.T) took 1.6-2x as long
for 2-4 rows as for one, while the same product as W @ x.T took 1.1-1.3x; in bf16 there the second
form was twice as slow. So the form is timed per machine, per number of rows, on the model's own
weight shapes, and used only where it wins.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections import Counter
from collections.abc import Collection, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 64  # the transposed form is considered up to this many rows; prefills and longer inputs keep F.linear
MIN_GAIN = 0.9  # it must take at most this share of F.linear's time
PAD_ROWS = 8


def _linears(model: nn.Module) -> list[nn.Linear]:
    """Plain nn.Linear layers (exact type: quantized and adapter layers subclass it with forwards of
    their own) without a forward set on the instance (accelerate's offloading hooks set one)."""
    return [m for m in model.modules() if type(m) is nn.Linear and "forward" not in m.__dict__]


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) as (weight @ x.T).T. Past `PAD_ROWS` rows, x gets zero rows up to a
    multiple of `PAD_ROWS`: on the AVX2 CPU above, 15 rows took 2.4x as long as 16 in this form."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = (-n) % PAD_ROWS if n > PAD_ROWS else 0
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.mm(weight, rows.t())[:, :n].t()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: Collection[int]
           ) -> torch.Tensor:
    """F.linear(x, weight, bias), computed by `transposed_linear` where x's row count is in `transposed`."""
    if x.dim() >= 2 and x.numel() // x.shape[-1] in transposed:
        return transposed_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


@torch.no_grad()
def faster_transposed(models: Iterable[nn.Module], reps: int = 2) -> list[int]:
    """The row counts (2..MAX_ROWS) at which W @ x.T beats F.linear over the models' linear layers,
    each weight shape weighted by how often it occurs. Timed at 2, 4, 8, ... rows, each count taking
    the form of the power of two below it (past 8 rows, padding makes a count cost what the next
    multiple of 8 does), until two in a row lose. CPU only: elsewhere, none."""
    shapes = Counter()
    weights = {}
    for model in models:
        for m in _linears(model):
            shapes[tuple(m.weight.shape)] += 1
            weights[tuple(m.weight.shape)] = m.weight
    if not weights or next(iter(weights.values())).device.type != "cpu":
        return []
    faster, losses, n = [], 0, 2
    while n <= MAX_ROWS and losses < 2:
        linear = transposed = 0.0
        for shape, weight in weights.items():
            x = torch.randn(n, weight.shape[1], dtype=weight.dtype)
            linear += shapes[shape] * _best_ms(lambda: F.linear(x, weight), reps)
            transposed += shapes[shape] * _best_ms(lambda: transposed_linear(x, weight, None), reps)
        if transposed < MIN_GAIN * linear:
            faster.extend(range(n, min(2 * n, MAX_ROWS + 1)))
            losses = 0
        else:
            losses += 1
        n *= 2
    return faster


@contextlib.contextmanager
def transposed_linears(models: Iterable[nn.Module], rows: Collection[int]) -> Iterator[None]:
    """Within the block, the models' plain nn.Linear layers multiply inputs of `rows` rows as W @ x.T."""
    rows = frozenset(rows)
    if not rows:
        yield
        return

    def forward(self, x):
        return linear(x, self.weight, self.bias, rows)

    layers = list({id(m): m for model in models for m in _linears(model)}.values())  # a layer listed twice once
    for m in layers:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward
