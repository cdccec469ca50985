"""What the heads read from the base's lm_head: its rows restricted to the draft vocabulary (`DraftLMHead`, in
the base's dtype or as int8 rows), token embeddings read from those rows (`LMHeadEmbedding`), and the likeliest
tokens of the logits they give (`top_probabilities`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from clover_hf import cpu
from clover_hf.core.quantized import dense, plain
from clover_hf.cpu import LinearForms, linear, make_copy


class LMHeadEmbedding(nn.Module):
    """Token embeddings read from an lm_head's rows (Clover-2 embeds drafted tokens so); holds no weights of its own."""

    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self._lm_head = [lm_head]  # in a list: the base's module, not a submodule of this one
        # a quantized lm_head is read back once, here (one plan of a decoding call holds this module)
        self._dense = None if plain(lm_head.weight) else [dense(lm_head.weight).detach()]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self._lm_head[0].weight if self._dense is None else self._dense[0])


@dataclass(frozen=True, eq=False)
class DraftLMHead:
    """The base lm_head's rows that the heads draft from: logits = hidden @ weight.T (+ bias)."""

    weight: torch.Tensor  # (V', H) in the base's dtype, or int8 rows scaled by `scales`
    bias: torch.Tensor | None = None
    scales: torch.Tensor | None = None  # (V',) per-row scales of int8 rows, in the activations' dtype
    forms: LinearForms = field(default_factory=dict)  # how each row count is computed (`linears.faster_forms`)
    kernel: Callable[[torch.Tensor], torch.Tensor] | None = None  # int8 rows' product of bf16 rows, by `bf16_kernel`
    # the rows' copies for forms that compute from one, made at first use and shared by the copies `replace` makes
    copies: dict[str, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return linear(hidden.to(self.weight.dtype), self.weight, self.bias, self.forms, self._copy)
        if self.kernel is not None and hidden.dtype == torch.bfloat16 and hidden.is_cpu:
            return self.kernel(hidden)
        x = hidden.to(self.scales.dtype).reshape(-1, hidden.shape[-1]).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        out = out.view(*hidden.shape[:-1], self.weight.shape[0])
        return out if self.bias is None else out + self.bias

    def _copy(self, form: str) -> torch.Tensor | None:
        """The rows' copy for `form`, a form that computes from one (as the forms' layers do from theirs): without
        one, a copy form would compute in F.linear, many times slower for the draft rows' few rows, and a drafting
        step's largest cost."""
        if form not in self.copies:
            with torch.inference_mode(False):  # kept past the call that makes it, as the rows are
                self.copies[form] = make_copy(self.weight, form)
        return self.copies[form]

    @staticmethod
    def int8_fits(weight: torch.Tensor) -> bool:
        """Whether int8 rows serve this weight: on the CPU, in fp32 or bf16, with a hidden size that is
        a multiple of 16. With bf16 rows and other sizes the kernel gave wrong numbers or crashed
        (torch 2.13, AVX-512 CPU; other builds were not checked)."""
        on_cpu = weight.device.type == "cpu"
        return on_cpu and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 16 == 0

    @classmethod
    def quantized(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> DraftLMHead:
        """Symmetric int8 rows, one scale per row (max |w| / 127, rounded to the weight's dtype first). In bf16 on a
        CPU the kernel's int8 product computes them where it is built (`cpu.int8_product`), a little faster than
        torch's int8 kernel."""
        w = weight.float()
        scales = (w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127).to(weight.dtype)
        rows = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        kernel = cpu.int8_product(rows, scales, bias) if cpu.serves(weight) else None
        return cls(rows, bias, scales, kernel=kernel)


def top_probabilities(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each row of `logits` (N, V) and their probabilities (float32), likeliest first:
    softmax then topk, or `cpu.top_probs` in one call where it serves."""
    fast = cpu.top_probs(logits, k)
    if fast is not None:
        return fast
    top = logits.float().softmax(-1).topk(k, dim=-1)
    return top.values, top.indices
