"""The kernel's choices from logits (`kernels/select.c`): greedy acceptance's argmax, the heads' softmax top-k, a
top-k warper's cut, and an lm_head's screen (`Screen`), its argmax and top-k without computing all its logits."""

from __future__ import annotations

import torch

from .kernel_library import KERNEL, contiguous, pointer
from .kernel_products import TILE, fits


def argmax(scores: torch.Tensor) -> torch.Tensor | None:
    """`scores.argmax(-1)` of float32 rows (N, V) on the CPU, the same indices (the first largest, a NaN counting as
    the largest), in one call: several times faster than torch's over a vocabulary's logits. None where the kernel is
    not loaded (it is never built for this alone) or the rows are not float32 on the CPU, each contiguous."""
    if KERNEL.lib is None or scores.dtype is not torch.float32 or not scores.is_cpu or scores.dim() != 2 or (
            scores.stride(1) != 1 and scores.shape[1] > 1):
        return None
    rows, width = scores.shape
    if rows and not width:
        return None  # torch refuses an empty row
    out = torch.empty(rows, dtype=torch.int64)
    if rows:
        KERNEL.lib.argmax_rows(scores.data_ptr(), scores.stride(0), rows, width, out.data_ptr(),
                               torch.get_num_threads())
    return out


TOP_MOST = 64  # the most tokens a row `top_probs` ranks (the kernel's TOP_MOST)


def top_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`logits.float().softmax(-1).topk(k)` of bf16 rows (N, V) on the CPU, as (probabilities, indices), in one call
    where torch ran three ops a drafting level. Of equal logits the first ranks first; the probabilities' sums add in
    another order than torch's. None where no kernel is loaded or the input is not of that form (or k is over
    TOP_MOST)."""
    if (KERNEL.lib is None or logits.dtype is not torch.bfloat16 or not logits.is_cpu or logits.dim() != 2
            or not 0 < k <= min(TOP_MOST, logits.shape[1])):
        return None
    logits = contiguous(logits)
    rows = logits.shape[0]
    probs, indices = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.int64)
    if rows:
        KERNEL.lib.top_probs(logits.data_ptr(), rows, logits.shape[1], k, indices.data_ptr(), probs.data_ptr(),
                             torch.get_num_threads())
    return probs, indices


def top_k_columns(scores: torch.Tensor, k: int, marked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A top-k warper's cut of float32 `scores` (R, n) on the CPU, as transformers' TopKLogitsWarper makes it (a score
    below its row's k-th largest is removed): each row's k-th largest (R,) and, ascending, the columns (C,) that some
    row keeps or that `marked` (int64 column ids) names. None where no kernel is loaded, the inputs are not of that
    form (a marked column out of range too) or a score is a NaN."""
    if (scores.dim() != 2 or scores.dtype is not torch.float32 or not scores.is_cpu or scores.stride(1) != 1
            or not 0 < k <= scores.shape[1] or marked.dtype is not torch.int64 or not marked.is_cpu
            or not KERNEL.available()):
        return None
    rows, n = scores.shape
    marked = contiguous(marked)
    kth, columns = torch.empty(rows), torch.empty(n, dtype=torch.int64)
    count = KERNEL.lib.top_k_columns(scores.data_ptr(), scores.stride(0), rows, n, k, marked.data_ptr(), marked.numel(),
                                     kth.data_ptr(), columns.data_ptr(), torch.get_num_threads())
    return None if count < 0 else (kth, columns[:count])


class Screen:
    """Greedy choices of an lm_head without its whole product (`bf16_screen_argmax`): each row's first largest logit
    of x @ weight.T (+ bias), as `product(tile(weight), bias)` computes and rounds it, from an int8 copy of the weight
    that bounds every logit and the exact product of the few columns whose bound reaches the largest (a handful a
    row). The copy holds a byte a weight, half the bf16 copy's bytes, read instead of it: the lm_head's greedy choice
    in less time than its product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Made by `of`, which checks what the kernel takes: `weight` bf16 (O x I) on the CPU, contiguous."""
        self.weight = weight.detach()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        out_features, in_features = weight.shape
        self.tiled = torch.empty(out_features // TILE, in_features // 2, TILE, 2, dtype=torch.int8)
        self.scales, self.resid, self.norms = (torch.empty(out_features) for _ in range(3))
        self.finite = bool(KERNEL.lib.screen_prepare(
            self.weight.data_ptr(), in_features, out_features, self.tiled.data_ptr(),
            self.scales.data_ptr(), self.resid.data_ptr(), self.norms.data_ptr(), torch.get_num_threads()))
        self.counts: torch.Tensor | None = None  # the columns each row of the last call computed exactly

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Screen | None":
        """The screen of `weight` (O x I, contiguous), or None where the kernel's product does not take it (`fits`),
        a weight is not finite, or no kernel is built (asked last)."""
        if not (weight.dim() == 2 and fits(weight) and weight.is_contiguous()
                and (bias is None or bias.shape == weight.shape[:1]) and KERNEL.available()):
            return None
        screen = cls(weight, bias)
        return screen if screen.finite else None

    def nbytes(self) -> int:
        """Memory the screen holds beside the weight."""
        return sum(t.numel() * t.element_size() for t in (self.tiled, self.scales, self.resid, self.norms))

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The argmax (N,) int64 of the logits of bf16 rows x (N, I), or None (nothing chosen) where x is not of that
        form or not finite."""
        out_features, in_features = self.weight.shape
        if not (x.dim() == 2 and x.shape[1] == in_features and x.shape[0] and x.dtype is torch.bfloat16 and x.is_cpu):
            return None
        x = contiguous(x)
        rows = x.shape[0]
        out, counts = torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int32)
        failed = KERNEL.lib.bf16_screen_argmax(
            x.data_ptr(), rows, self.tiled.data_ptr(), self.scales.data_ptr(), self.resid.data_ptr(),
            self.norms.data_ptr(), pointer(self.bias), self.weight.data_ptr(), in_features, out_features,
            out.data_ptr(), counts.data_ptr(), torch.get_num_threads())
        if failed == 1:
            raise MemoryError(f"bf16_kernel: no memory to screen {rows} rows")
        self.counts = counts
        return None if failed else out

    def top_k(self, x: torch.Tensor, k: int, room: int = 4096) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For bf16 rows x (N, I): the columns (C,) ascending that may hold one of some row's k largest logits (every
        column at least a row's k-th largest is among them: C >= k) and their logits (N, C) float32, as the lm_head
        computes and rounds them (`bf16_screen_top_k`). None where x is not of that form or not finite, or more than
        `room` columns would be taken."""
        out_features, in_features = self.weight.shape
        if not (x.dim() == 2 and x.shape[1] == in_features and x.shape[0] and x.dtype is torch.bfloat16 and x.is_cpu
                and 0 < k <= out_features):
            return None
        x = contiguous(x)
        rows, room = x.shape[0], min(room, out_features)
        columns, values = torch.empty(room, dtype=torch.int64), torch.empty(rows * room)
        counts = torch.empty(rows, dtype=torch.int32)
        taken = KERNEL.lib.bf16_screen_top_k(
            x.data_ptr(), rows, self.tiled.data_ptr(), self.scales.data_ptr(), self.resid.data_ptr(),
            self.norms.data_ptr(), pointer(self.bias), self.weight.data_ptr(), in_features, out_features, k,
            columns.data_ptr(), values.data_ptr(), room, counts.data_ptr(), torch.get_num_threads())
        if taken == -1:
            raise MemoryError(f"bf16_kernel: no memory to screen {rows} rows")
        if taken < 0:
            return None
        self.counts = counts
        return columns[:taken], values[: rows * taken].view(rows, taken)
