"""The kernel's products (`kernels/products.c`): x @ weight.T (+ bias) of a few bf16 rows from the weight laid out
in tiles (`tile`).

Verify forwards multiply 1-16 rows by every weight. The kernel reads each weight byte once for a block of rows (14
with AVX-512-BF16's bf16 pair products, 4 with AVX2, which widens the weights to float32 in registers; more rows
there take up to 6 a pass over half a tile, a chunk of it at a time while it stays in L1), in a layout that streams
through memory in order, and returns with little fixed cost a call (less than oneDNN's blocked product). Where torch
has no native bf16 products (AVX2-only CPUs) it converts bf16 to float32 around each one; this kernel reads the bf16
bytes alone. Like every form, it is used only where timed faster. Sums are float32, as torch's bf16 products; their
order differs, so bf16 outputs may round differently (fp32 is untouched).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .kernel_library import KERNEL

TILE = 32  # output columns per tile: a weight needs a multiple of it, and an even number of inputs


def fits(weight: torch.Tensor) -> bool:
    """Whether the kernel computes products by `weight`: bf16 on the CPU, a multiple of TILE rows, even columns."""
    rows, cols = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and rows % TILE == 0 and cols % 2 == 0


def tile(weight: torch.Tensor, *stacked: torch.Tensor) -> torch.Tensor:
    """`weight` (O x I) laid out for the kernel: (O / TILE, I / 2, TILE, 2); with `stacked` weights of as many
    inputs (each of a multiple of TILE rows), that of `torch.cat([weight, *stacked])`, without making it. Each input
    pair moves as one 4-byte value, a few times faster than 2-byte values moved after stacking: these copies are
    much of a first call's fixed cost."""
    weights = [w.detach() for w in (weight, *stacked)]
    cols = weights[0].shape[1]
    out = torch.empty(sum(w.shape[0] for w in weights) // TILE, cols // 2, TILE, 2, dtype=weights[0].dtype,
                      device=weights[0].device)
    at = 0
    for w in weights:
        blocks, into = w.shape[0] // TILE, out[at : at + w.shape[0] // TILE]
        if w.is_contiguous() and w.storage_offset() % 2 == 0 and w.dtype.itemsize == 2:
            into.view(torch.int32).view(blocks, cols // 2, TILE).copy_(
                w.view(torch.int32).view(blocks, TILE, cols // 2).transpose(1, 2))
        else:
            into.copy_(w.reshape(blocks, TILE, cols // 2, 2).transpose(1, 2))
        at += blocks
    return out


def product(tiled: torch.Tensor, bias: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x @ weight.T (+ bias) as a function of bf16 x, from `tile(weight)`, in torch's number of threads."""
    run, empty, bf16 = KERNEL.lib.bf16_rows, torch.empty, torch.bfloat16
    out_features, in_features = tiled.shape[0] * TILE, tiled.shape[1] * 2
    bias = None if bias is None else bias.detach().float().contiguous()
    weight_at, bias_at, threads = tiled.data_ptr(), 0 if bias is None else bias.data_ptr(), torch.get_num_threads()

    # `_memory`: what the pointers above point into, held as long as the function is
    def compute(x: torch.Tensor, _memory: tuple = (tiled, bias)) -> torch.Tensor:
        # as few tensor calls as may be: each costs about a microsecond, and a forward runs over a hundred products
        if x.dtype is not bf16 or not x.is_cpu:  # F.linear refuses a bf16 weight for other x too
            raise TypeError(f"bf16_kernel: a bf16 weight's product takes bf16 rows on the CPU, not {x.dtype} on {x.device}")
        if x.shape[-1] != in_features:  # as F.linear refuses it
            raise RuntimeError(f"bf16_kernel: rows of {x.shape[-1]} values cannot multiply a weight of {in_features} "
                               "inputs")
        if not x.is_contiguous():
            x = x.contiguous()
        rows = x.numel() // in_features
        out = empty(x.shape[:-1] + (out_features,), dtype=bf16)
        if run(x.data_ptr(), weight_at, bias_at, out.data_ptr(), rows, in_features, out_features, threads):
            raise MemoryError(f"bf16_kernel: no memory for {rows} rows in float32")
        return out

    return compute


def linear(x: torch.Tensor, tiled: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) from `tile(weight)`."""
    return product(tiled, bias)(x)

