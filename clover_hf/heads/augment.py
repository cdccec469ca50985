"""The Augmenting Block's decoder layers and the cache of keys and values they keep for the accepted tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from clover_hf import cpu
from clover_hf.base.cache import GrowingLayer
from clover_hf.base.parts import apply_rope
from clover_hf.cpu import layer_weights

from .config import CloverConfig
from .norm import RMSNorm
from .rope import RotaryTable


@dataclass
class AugmentCache:
    """Keys and values of the Augmenting Block's layers for the tokens accepted so far, a growing layer each
    (`cache.GrowingLayer`: new positions are written in place, where concatenating copied the whole cache)."""

    layers: list[GrowingLayer]

    @property
    def length(self) -> int:
        return self.layers[0].get_seq_length() if self.layers else 0


class KernelLayerSlot:
    """A layer's `cpu.DecoderLayer` and the norm weights it was made for, or nothing. Copies and pickles of the
    module that holds it start empty: the kernel layer's ctypes pointers can be neither copied nor pickled."""

    def __init__(self) -> None:
        self.made: tuple[torch.Tensor, torch.Tensor, cpu.DecoderLayer] | None = None

    def __deepcopy__(self, memo: dict) -> KernelLayerSlot:
        return KernelLayerSlot()

    def __reduce__(self) -> tuple:
        return KernelLayerSlot, ()


class AugmentLayer(nn.Module):
    """A pre-norm decoder layer (GQA self-attention with RoPE, SwiGLU MLP) with an explicit cache."""

    def __init__(self, config: CloverConfig, rotary: RotaryTable | None = None) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.rope_theta = config.rope_theta
        self.rotary = rotary if rotary is not None else RotaryTable(hd, config.rope_theta)
        self.kernel_slot = KernelLayerSlot()
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, self.n_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * hd, bias=False)
        self.o_proj = nn.Linear(self.n_heads * hd, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.gate_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, h, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # (B, T, H)
        positions: torch.Tensor,  # (B, T)
        cache: GrowingLayer | None = None,  # keys and values of earlier positions, extended by these
        attn_mask: torch.Tensor | None = None,  # additive, or bool (True: attend), (B, 1, T, past+T); None: causal
    ) -> torch.Tensor:
        B, T, _ = x.shape
        cos, sin = self.rotary(positions, x.dtype)
        # drafting in bf16 on the CPU: the whole layer in one `bf16_kernel` call where its products are in the kernel's
        # tiled copies, else the rotary embedding and the attention in one call each
        kernel = not torch.is_grad_enabled() and attn_mask is None and cpu.serves(x)
        if kernel and cache is not None:
            out = self._whole_layer(x, cos[:, 0], sin[:, 0], cache)
            if out is not None:
                return out
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(y).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(y).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        turned = cpu.rope(q, k, cos[:, 0], sin[:, 0]) if kernel else None
        q, k = turned if turned is not None else (apply_rope(q.transpose(1, 2), cos, sin),
                                                  apply_rope(k.transpose(1, 2), cos, sin))
        if cache is not None:
            k, v = cache.update(k, v)
        out = self._kernel_attention(q, k, v) if kernel else None
        if out is not None:
            x = x + self.o_proj(out.reshape(B, T, -1))
        else:
            x = x + self.o_proj(self._attention(q, k, v, attn_mask).transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(x)
        gate, up = self.gate_proj(y), self.up_proj(y)
        mixed = cpu.silu_mul(gate, up) if kernel else None
        return x + self.down_proj(F.silu(gate) * up if mixed is None else mixed)

    def _whole_layer(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: GrowingLayer
                     ) -> torch.Tensor | None:
        """The layer as one `cpu.DecoderLayer` call (bitwise its calls one by one below), extending `cache`;
        None (nothing done) where its products are not all in the kernel's tiled copies (`linears.linear_forms`),
        the cache holds no keys yet, or the norms differ in epsilon."""
        layer, weights = self.kernel_layer(), self.kernel_weights(x.numel() // x.shape[-1])
        if layer is None or weights is None:
            return None
        return cache.extend(layer, x, cos, sin, weights, None, causal=True)

    def kernel_layer(self) -> cpu.DecoderLayer | None:
        """This layer as a `cpu.DecoderLayer` (made again after `.to()`); None where its norms differ in
        epsilon."""
        norms = (self.input_layernorm, self.post_attention_layernorm)
        if norms[0].eps != norms[1].eps:
            return None
        made = self.kernel_slot.made
        if made is None or made[0] is not norms[0].weight or made[1] is not norms[1].weight:
            layer = cpu.DecoderLayer(norms[0].weight, norms[1].weight, float(norms[0].eps), self.n_heads,
                                     self.n_kv, self.head_dim, self.head_dim**-0.5)
            made = self.kernel_slot.made = (norms[0].weight, norms[1].weight, layer)
        return made[2]

    def kernel_weights(self, rows: int) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """The tiled weights `kernel_layer` computes `rows` rows from (`linears.layer_weights`), or None."""
        return layer_weights(rows, self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj, self.up_proj,
                             self.down_proj)

    def _kernel_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
        """Causal attention of the new positions (B, heads, T, hd) over the cache and themselves, by `bf16_kernel`
        (B, T, heads, hd), reading for each few query rows only the keys they see (a long prompt's first catch-up
        over all its positions); None where it has none."""
        return cpu.attention(q, k, v, None, self.head_dim**-0.5, causal=q.shape[2] > 1)

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None
                   ) -> torch.Tensor:
        """SDPA of the new positions (B, heads, T, hd), causal over the cache and themselves unless `attn_mask`."""
        T = q.shape[2]
        if q.device.type == "cpu":  # the CPU kernels read shared KV heads directly, masked or not
            kk, vv, gqa = k, v, {"enable_gqa": True}
        else:  # elsewhere a mask with shared KV heads can fall back to the math kernel
            rep = self.n_heads // self.n_kv
            kk, vv, gqa = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), {}
        if attn_mask is None and k.shape[-2] > T:
            causal = torch.ones(T, k.shape[-2], dtype=torch.bool, device=q.device).tril(k.shape[-2] - T)
            return F.scaled_dot_product_attention(q, kk, vv, attn_mask=causal, **gqa)
        if attn_mask is None:
            return F.scaled_dot_product_attention(q, kk, vv, is_causal=T > 1, **gqa)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=attn_mask, **gqa)
