"""Draft heads: Clover's (Augmenting Block, Attention Decoder, Regressive Connection, output heads)
and Medusa-1's, the baseline Clover is measured against.

The heads never hold vocabulary-sized weights: token embeddings and the lm_head come from the base
model at run time and are passed in explicitly (`embed`, and the lm_head rows as a `DraftLMHead`).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from clover_hf import cpu
from clover_hf.base.cache import GrowingLayer
from clover_hf.base.parts import apply_rope, decoder_layers, rms_final_norm
from clover_hf.core.quantized import dense, plain, readable
from clover_hf.core.watch import unchanged, watch
from clover_hf.cpu import BlockMemo, LinearForms, kernel_weights, layer_weights, linear, make_copy

from .config import CloverConfig

if TYPE_CHECKING:
    from .tree import TreeBuffers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and x.dtype == self.weight.dtype and cpu.serves(x):
            return cpu.norm(x, self.weight, self.eps)  # one call for the six ops below (drafting in bf16)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (B, 1, T, head_dim) of the rotary embedding at positions (B, T). Without gradients on the CPU they
    are read from a table of every position up to the largest seen (`_position_table`): drafting steps took ten
    ops to compute them."""
    if not torch.is_grad_enabled() and positions.device.type == "cpu" and positions.numel():
        rows = positions.tolist()
        cos, sin = _position_table(max(max(row) for row in rows) + 1, head_dim, theta, dtype)
        start, count = rows[0][0], len(rows[0])
        if len(rows) == 1 and rows[0] == list(range(start, start + count)):  # one row of positions in order: a view
            return cos[None, None, start : start + count], sin[None, None, start : start + count]
        return cos[positions][:, None], sin[positions][:, None]
    return _rope_angles(positions, head_dim, theta, dtype)


def _rope_angles(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[:, None, :, None] * inv_freq  # (B, 1, T, hd/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)


_POSITION_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _position_table(length: int, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (P, head_dim) of positions 0..P-1, P at least `length` (a power of two, made again when longer
    is needed): the same elementwise ops `_rope_angles` runs on given positions."""
    key = (head_dim, theta, dtype)
    table = _POSITION_TABLES.get(key)
    if table is None or table[0].shape[0] < length:
        table = _POSITION_TABLES[key] = _new_position_table(length, head_dim, theta, dtype)
    return table


@torch.inference_mode(False)  # kept past the call that makes them
def _new_position_table(length: int, head_dim: int, theta: float, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    every = torch.arange(1 << max(length - 1, 1).bit_length())[None]
    return tuple(t[0, 0] for t in _rope_angles(every, head_dim, theta, dtype))


@dataclass
class AugmentCache:
    """Keys and values of the Augmenting Block's layers for the tokens accepted so far, a growing layer each
    (`cache.GrowingLayer`: new positions are written in place, where concatenating copied the whole cache)."""

    layers: list[GrowingLayer]

    @property
    def length(self) -> int:
        return self.layers[0].get_seq_length() if self.layers else 0


# each Augmenting Block layer's `cpu.DecoderLayer` (with the norm weights it was made for), kept outside the
# module: its ctypes pointers would stop the module from being copied or pickled
_KERNEL_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# the heads' features for drafting in one kernel call: heads -> (the kernel layers and norm weights it was made for,
# cpu.Features, its weights by row count: linears.BlockMemo), kept outside the module as above
_KERNEL_FEATURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# the heads' static-tree drafts in one kernel call: heads -> {id(tree): (tree, ids of the tensors it points into,
# cpu.StaticDraft, the bound forwards it was last looked up under)}, kept outside the module as above (the tree
# is kept too: its id names no other meanwhile)
_KERNEL_DRAFTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _embedding_table(embed: nn.Module) -> torch.Tensor | None:
    """The (vocabulary, hidden) table whose rows `embed` returns, where it is a plain lookup; else None."""
    if isinstance(embed, LMHeadEmbedding):
        return embed._lm_head[0].weight if embed._dense is None else embed._dense[0]
    if type(embed) is nn.Embedding and embed.max_norm is None:
        return embed.weight
    return None


class AugmentLayer(nn.Module):
    """A pre-norm decoder layer (GQA self-attention with RoPE, SwiGLU MLP) with an explicit cache."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h, hd = config.hidden_size, config.head_dim
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, hd
        self.rope_theta = config.rope_theta
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
        cos, sin = rope_tables(positions, self.head_dim, self.rope_theta, x.dtype)
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
        made = _KERNEL_LAYERS.get(self)
        if made is None or made[0] is not norms[0].weight or made[1] is not norms[1].weight:
            layer = cpu.DecoderLayer(norms[0].weight, norms[1].weight, float(norms[0].eps), self.n_heads,
                                             self.n_kv, self.head_dim, self.head_dim**-0.5)
            made = _KERNEL_LAYERS[self] = (norms[0].weight, norms[1].weight, layer)
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


class AttentionDecoder(nn.Module):
    """Merges a state with a token embedding through a per-head cosine gate: h + v(e) * cos(q(h), k(e))."""

    shared_input = False  # q reads the state, k and v the embedding: no stacked product (`linears.shared_input_groups`)

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, h, bias=config.decoder_bias)
        self.k_proj = nn.Linear(h, h, bias=config.decoder_bias)
        self.v_proj = nn.Linear(h, h, bias=config.decoder_bias)
        nn.init.zeros_(self.v_proj.weight)  # starts as the identity on h
        if config.decoder_bias:
            nn.init.zeros_(self.v_proj.bias)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and cpu.serves(h):  # drafting in bf16: one call where the products can
            rows = h.numel() // h.shape[-1]
            projections = [kernel_weights(p, rows, [p.out_features]) for p in (self.q_proj, self.k_proj, self.v_proj)]
            out = None if None in projections else cpu.attention_decoder(
                h, e, self.norm.weight, self.norm.eps, projections, self.n_heads)
            if out is not None:
                return out
        q, k, v = self.q_proj(self.norm(h)), self.k_proj(e), self.v_proj(e)
        if not torch.is_grad_enabled() and h.shape == q.shape == k.shape == v.shape and cpu.serves(h) and (
                q.dtype == k.dtype == v.dtype == h.dtype):
            return cpu.cosine_gate(h, q, k, v, self.n_heads)  # drafting in bf16: one call for the lines below
        shape = (*h.shape[:-1], self.n_heads, -1)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        gate = F.cosine_similarity(q, k, dim=-1).unsqueeze(-1)  # (..., n_heads, 1)
        return h + (v * gate).flatten(-2)


class OutputHead(nn.Module):
    """Head i: normed features norm(s + SiLU(FC([s; e]))) that the base's lm_head turns into logits."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and cpu.serves(s):  # drafting in bf16: one call where the product can
            fc = kernel_weights(self.fc, s.numel() // s.shape[-1], [self.fc.out_features])
            out = None if fc is None else cpu.output_head(s, e, fc, self.norm.weight, self.norm.eps)
            if out is not None:
                return out
        return self.norm(s + F.silu(self.fc(torch.cat([s, e], dim=-1))))


def _near_identity(weight: torch.Tensor, spread: float = 0.01) -> None:
    """Clover-2's start for a square or [I | ...] weight: U(0, spread) plus the identity on its first columns."""
    nn.init.uniform_(weight, 0.0, spread)
    weight[:, : weight.shape[0]] += torch.eye(weight.shape[0], dtype=weight.dtype, device=weight.device)


class LinearOutputHeads(nn.Module):
    """Clover-2's output heads (its public code): norm(W0 s) for the first head, norm(W [s; e]) with one W
    shared by the others, one norm for all; both W start near the identity on s."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.first = nn.Linear(h, h)
        self.later = nn.Linear(2 * h, h)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        with torch.no_grad():
            for fc in (self.first, self.later):
                _near_identity(fc.weight)
                nn.init.zeros_(fc.bias)

    def forward(self, i: int, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.norm(self.first(s) if i == 0 else self.later(torch.cat([s, e], dim=-1)))


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
        """The rows' copy for `form`, a form that computes from one (as the forms' layers do from theirs): without one, a
        copy form computes in F.linear, which took 5.6 ms for 3 rows of SmolLM2's 8,192 draft rows in float32 against
        0.21 from oneDNN's blocked copy (AVX-512-bf16 EPYC, Zen 4), most of a drafting step."""
        if form not in self.copies:
            with torch.inference_mode(False):  # kept past the call that makes it, as the rows are
                self.copies[form] = make_copy(self.weight, form)
        return self.copies[form]

    @staticmethod
    def int8_fits(weight: torch.Tensor) -> bool:
        """Whether int8 rows serve this weight: on the CPU, in fp32 or bf16, with a hidden size that is
        a multiple of 16. With bf16 rows and other sizes the kernel gave wrong numbers or crashed
        (torch 2.13, AVX-512 CPU; other builds were not checked)."""
        cpu = weight.device.type == "cpu"
        return cpu and weight.dtype in (torch.float32, torch.bfloat16) and weight.shape[1] % 16 == 0

    @classmethod
    def quantized(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> DraftLMHead:
        """Symmetric int8 rows, one scale per row (max |w| / 127, rounded to the weight's dtype first). In bf16 on a
        CPU the kernel's int8 product computes them where it is built (`cpu.int8_product`): SmolLM2's drafting
        took 1.59 against 1.70 ms a step in torch's int8 kernel (AVX-512-bf16 EPYC, alternating)."""
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


class DraftHeads(nn.Module):
    """What every kind of draft heads shares: the config, the draft vocabulary and its lm_head rows.

    Subclasses provide `features` (per accepted position, with an optional cache), `forward` (the
    teacher-forced training pass) and `draft` (a static tree's tokens), so training and the decoding
    loop serve them all; those with `dynamic_trees` also draft EAGLE-2-style trees (`draft_dynamic`).
    """

    dynamic_trees = False

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.config = config
        if config.draft_vocab_size is not None:
            # Which base-vocabulary ids the heads draft from; filled by training (most frequent tokens).
            self.register_buffer("draft_token_ids", torch.arange(config.draft_vocab_size), persistent=True)
        else:
            self.draft_token_ids = None
        self._lm_head_rows: tuple[list, bool, DraftLMHead] | None = None  # (sources, int8, rows)

    def draft_lm_head(self, lm_head: nn.Module, int8: bool = False) -> DraftLMHead:
        """The base lm_head restricted to the draft vocabulary (all rows without one).

        `int8=True` keeps the draft-vocabulary rows as int8 with a scale per row, where the heads
        have a draft vocabulary and the kernel takes the hidden size. On a CPU in bf16, drafting reads
        these rows from memory at every depth of every step, their largest cost; int8 halves the read
        (in fp32 the int8 kernel was no faster than the fp32 product, so decoding uses it in bf16).
        A quantized lm_head (torchao's, bitsandbytes') is dequantized into the rows.
        Drafts, and so the tokens accepted per step, may change slightly; the output does not (greedy
        stays identical to the base's in fp32, sampling keeps its distribution). The rows are built
        once and kept until the lm_head or the draft vocabulary changes.
        """
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if self.draft_token_ids is None and plain(weight):
            return DraftLMHead(weight, bias)
        int8 = int8 and self.draft_token_ids is not None and DraftLMHead.int8_fits(weight)
        sources = [weight, bias, self.draft_token_ids]
        memo = self._lm_head_rows
        if memo is None or memo[1] != int8 or not unchanged(memo[0], sources):
            with torch.inference_mode(False):  # kept past the call that builds them (decoding runs in inference mode)
                ids = slice(None) if self.draft_token_ids is None else self.draft_token_ids.to(weight.device)
                rows, bias = dense(weight).detach()[ids], None if bias is None else bias.detach()[ids]
                rows = DraftLMHead.quantized(rows, bias) if int8 else DraftLMHead(rows, bias)
            self._lm_head_rows = ([watch(t) for t in sources], int8, rows)
        return self._lm_head_rows[2]

    def token_embedding(self, base_model: nn.Module) -> nn.Module:
        """How the heads embed tokens (the drafted ones, and those that follow each accepted position): the
        base's input embeddings, or with `embed_from_lm_head` its lm_head's rows."""
        if self.config.embed_from_lm_head:
            return LMHeadEmbedding(base_model.get_output_embeddings())
        return base_model.get_input_embeddings()

    def init_from_base(self, base_model: nn.Module, norms: bool = False) -> bool:
        """Copy what fits from the base into fresh heads; returns whether anything was copied."""
        return False

    def upgrade_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weights saved by an earlier release, renamed to this release's layout (here: as they are)."""
        return state

    def init_projections(self, lm_head: nn.Module) -> None:
        """Start projections of their own from the base's lm_head rows (once the draft vocabulary is chosen)."""

    def head_logits(self, i: int, hidden: torch.Tensor, lm_head: DraftLMHead) -> torch.Tensor:
        """Logits over the draft vocabulary of head i's output `hidden`: through the base's lm_head rows."""
        return lm_head(hidden)

    def draft_feature(self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                      cache) -> torch.Tensor | None:
        """The last position's feature, as `features` computes it, by a faster path where the heads have one; else
        None (nothing done): here none."""
        return None


class CloverHeads(DraftHeads):
    """All of Clover's trainable parts. Head i drafts the token i+2 positions after the state's token."""

    dynamic_trees = True

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config)
        self.input_decoder = AttentionDecoder(config)
        self.augment = nn.ModuleList(AugmentLayer(config) for _ in range(config.num_augment_layers))
        self.augment_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.regressive = AttentionDecoder(config)
        if config.output_head == "linear":
            self.output = LinearOutputHeads(config)
        else:
            self.heads = nn.ModuleList(OutputHead(config) for _ in range(config.num_heads))

    def _head(self, i: int, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """Head i's output features from the state s and the embedding e of the token before its own."""
        if self.config.output_head == "linear":
            return self.output(i, s, e)
        return self.heads[i](s, e)

    # -- features -------------------------------------------------------------------------------
    def features(
        self,
        hidden: torch.Tensor,  # (B, T, H) base last hidden states at positions t
        next_embeds: torch.Tensor,  # (B, T, H) embeddings of tokens t+1
        positions: torch.Tensor,  # (B, T)
        cache: AugmentCache | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, AugmentCache]:
        """Augmenting Block over new positions; returns features (B, T, H) and the cache, extended in place."""
        x = self.input_decoder(hidden, next_embeds.to(hidden.dtype))
        cache = cache if cache is not None else AugmentCache([GrowingLayer() for _ in self.augment])
        for layer, stored in zip(self.augment, cache.layers):
            x = layer(x, positions, stored, attn_mask)
        return self.augment_norm(x), cache

    def draft_feature(self, hidden: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                      cache: AugmentCache | None) -> torch.Tensor | None:
        """`features(...)[0][0, -1]` for one row (1, T, H) extending `cache`, in one kernel call (`cpu.Features`)
        where it serves: bf16 on the CPU, a cache that holds keys, every product in the kernel's tiled copies; else
        None (nothing done)."""
        if (cache is None or torch.is_grad_enabled() or hidden.shape[0] != 1 or next_embeds.dtype is not hidden.dtype
                or not cpu.serves(hidden)):
            return None
        made = self._kernel_features(hidden.dtype)
        if made is None:
            return None
        rows, features = hidden.shape[1], made[1]
        weights = made[2].get(self.input_decoder.q_proj.forward, rows, self._feature_weights)
        length = cache.length
        stores = [stored.reserve_after(length, length + rows) for stored in cache.layers]
        if weights is None or None in stores:
            return None
        layer = self.augment[0]
        tables = _position_table(length + rows, layer.head_dim, layer.rope_theta, hidden.dtype)
        feature = features(hidden, next_embeds, positions, tables, length, *weights, stores,
                           [stored.key_layout() for stored in cache.layers])
        if feature is not None:
            for stored in cache.layers:
                stored.set_length(length + rows)
        return feature

    def _kernel_features(self, dtype: torch.dtype) -> tuple | None:
        """These heads' entry of `_KERNEL_FEATURES`, made again after `.to()`; None where the modules do not take the
        kernel's form."""
        decoder, norm = self.input_decoder, self.augment_norm
        if not (isinstance(decoder, AttentionDecoder) and decoder.norm.weight.dtype is dtype and norm.weight.dtype is dtype
                and self.augment):
            return None
        made = _KERNEL_FEATURES.get(self)
        layers = [layer.kernel_layer() for layer in self.augment]
        if None in layers:
            return None
        key = (*layers, decoder.norm.weight, norm.weight)
        if made is None or len(made[0]) != len(key) or any(a is not b for a, b in zip(made[0], key)):
            features = cpu.Features(decoder.norm.weight, decoder.norm.eps, decoder.n_heads, norm.weight,
                                            norm.eps, layers)
            made = _KERNEL_FEATURES[self] = (key, features, BlockMemo())
        return made

    def _feature_weights(self, rows: int) -> tuple[list, list] | None:
        """The input decoder's q/k/v and each Augmenting Block layer's tiled weights for `rows` rows; None where any
        computes otherwise."""
        decoder = self.input_decoder
        projections = [kernel_weights(p, rows, [p.out_features]) for p in (decoder.q_proj, decoder.k_proj,
                                                                           decoder.v_proj)]
        layers = [layer.kernel_weights(rows) for layer in self.augment]
        return None if None in projections or None in layers else (projections, layers)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Teacher-forced pass for training (a `forward`, so DDP syncs its gradients).

        hidden: (B, T, H) base states at t; next_embeds: (B, T, H) embeddings of x_{t+1}; position_ids
        (B, T), for rows of packed examples, restart at 0 where an example starts (none: one example).
        Returns per head i a (B, T-1-i, H) normed hidden at t = 0..T-2-i whose logits predict x_{t+2+i}.
        """
        B, T, _ = hidden.shape
        if position_ids is None:
            positions, mask = torch.arange(T, device=hidden.device).expand(B, -1), None
        else:  # each packed example attends to itself only: causal within its own block
            docs = document_ids(position_ids)
            causal = torch.ones(T, T, dtype=torch.bool, device=hidden.device).tril()
            positions, mask = position_ids, ((docs[:, :, None] == docs[:, None, :]) & causal)[:, None]
        s, _ = self.features(hidden, next_embeds, positions, attn_mask=mask)
        outs = []
        for i in range(self.config.num_heads):
            L = T - 1 - i
            if L <= 0:
                break
            e = next_embeds[:, i : i + L].to(s.dtype)  # e(x_{t+1+i})
            s = s[:, :L] if i == 0 else self.regressive(s[:, :L], e)
            outs.append(self._head(i, s, e))
        return outs

    @torch.no_grad()
    def draft(
        self,
        feature: torch.Tensor,  # (H,) features of the last accepted position
        root: torch.Tensor,  # () the token that follows it (already chosen, not yet verified by the cache)
        tree: "TreeBuffers",
        embed: nn.Module,
        lm_head: DraftLMHead,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft the tree's tokens (num_nodes - 1,), one batched step per depth, and the heads'
        probability of each token at its parent (num_nodes - 1,)."""
        whole = self._kernel_draft(feature, root, tree, embed, lm_head)
        if whole is not None:
            return whole
        states = feature.view(1, -1)
        e = embed(root.view(1)).to(states.dtype)
        drafted, probs = [], []
        for d, level in enumerate(tree.levels):
            if d > 0:
                states = self.regressive(states[level.parent_of_expanded], e)
            top_p, top = top_probabilities(lm_head(self._head(d, states, e)), level.k)  # (n_expanded, k)
            ids = top if self.draft_token_ids is None else self.draft_token_ids[top]
            children = ids[level.child_parent, level.child_rank]  # (n_level,)
            drafted.append(children)
            probs.append(top_p[level.child_parent, level.child_rank])
            if level.next_expanded is not None:
                e = embed(children[level.next_expanded]).to(states.dtype)
        return torch.cat(drafted), torch.cat(probs)

    def _kernel_draft(self, feature: torch.Tensor, root: torch.Tensor, tree: "TreeBuffers", embed: nn.Module,
                      lm_head: DraftLMHead) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`draft` in one kernel call (`cpu.StaticDraft`) where it serves: bf16 on the CPU, draft rows in the
        kernel's int8 product, residual output heads, and every product at the levels' row counts tiled; else None."""
        table = _embedding_table(embed)
        if (table is None or lm_head.kernel is None or self.config.output_head != "residual"
                or torch.is_grad_enabled() or not cpu.serves(feature)):
            return None
        token = int(root)
        if not 0 <= token < table.shape[0]:  # the embedding's own lookup refuses it
            return None
        made = _KERNEL_DRAFTS.setdefault(self, {})
        found = made.get(id(tree))
        # a block of linear forms binds new forwards: within one, the weights looked up last time stand
        bound = (self.heads[0].fc.forward, lm_head.kernel, table, self.draft_token_ids)
        if found is not None and all(a is b for a, b in zip(found[3], bound)):
            return found[2](feature, token)
        regressive, weights = self.regressive, []
        for d, level in enumerate(tree.levels):
            rows = 1 if level.parent_of_expanded is None else level.parent_of_expanded.shape[0]
            head = self.heads[d]
            fc = kernel_weights(head.fc, rows, [head.fc.out_features])
            projections = [] if d == 0 else [kernel_weights(p, rows, [p.out_features])
                                             for p in (regressive.q_proj, regressive.k_proj, regressive.v_proj)]
            if fc is None or None in projections:
                return None
            weights.append(((*fc, head.norm.weight, head.norm.eps), projections))
        parts = [table, self.draft_token_ids, *lm_head.kernel.keep,
                 *(t for head, projections in weights for t in (*head[:3], *(t for pair in projections for t in pair)))]
        signature = tuple(id(t) for t in parts)
        if found is None or found[1] != signature:
            if not cpu.StaticDraft.fits(tree.levels, weights, lm_head.kernel.keep, self.draft_token_ids,
                                                table):
                return None
            draft = cpu.StaticDraft(tree.levels, weights, (regressive.norm.weight, regressive.norm.eps),
                                            regressive.n_heads, lm_head.kernel.keep, self.draft_token_ids, table)
            found = (tree, signature, draft)  # the tree kept: its id names no other while cached
        made[id(tree)] = (*found[:3], bound)
        return found[2](feature, token)

    @torch.no_grad()
    def draft_dynamic(
        self,
        feature: torch.Tensor,  # (H,)
        root: torch.Tensor,  # ()
        depth: int,
        width: int,
        embed: nn.Module,
        lm_head: DraftLMHead,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Candidates of an EAGLE-2-style tree: at each depth the `width` likeliest paths get `width` children.

        Returns, in drafting order, each candidate's token, parent (candidate index + 1; 0 is the
        root), depth and path log-probability under the heads.
        """
        states = feature.view(1, -1)
        e = embed(root.view(1)).to(states.dtype)
        path_logp = torch.zeros(1, device=feature.device)
        frontier = torch.zeros(1, dtype=torch.long, device=feature.device)  # node ids; the root is 0
        tokens, parents, depths, scores = [], [], [], []
        count = 1
        for d in range(depth):
            if d > 0:
                states = self.regressive(states, e)
            logp = lm_head(self._head(d, states, e)).float().log_softmax(-1)
            top = logp.topk(width, dim=-1)  # (F, width)
            ids = top.indices if self.draft_token_ids is None else self.draft_token_ids[top.indices]
            joint = (path_logp[:, None] + top.values).flatten()
            tokens.append(ids.flatten())
            parents.append(frontier.repeat_interleave(width))
            depths.append(torch.full_like(joint, d + 1, dtype=torch.long))
            scores.append(joint)
            node_ids = count + torch.arange(joint.shape[0], device=feature.device)
            count += joint.shape[0]
            if d + 1 < depth:
                keep = joint.topk(min(width, joint.shape[0])).indices
                states, e = states[keep // width], embed(ids.flatten()[keep]).to(states.dtype)
                path_logp, frontier = joint[keep], node_ids[keep]
        return torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(scores)

    # -- initialisation ----------------------------------------------------------------------
    @torch.no_grad()
    def init_from_base(self, base_model: nn.Module, norms: bool = False) -> bool:
        """Copy the base's last decoder layer into the Augmenting Block where names and shapes match,
        and with `norms` the base's final norm into the block's final norm (and the linear output
        heads' norm). Clover-2 initialises both this way; returns whether anything was copied.
        """
        layers = decoder_layers(base_model)
        if layers is None:
            return False
        gemma = str(getattr(base_model.config, "model_type", "")).startswith("gemma")
        final = rms_final_norm(base_model)
        if norms and final is not None and not gemma:  # Gemma's RMSNorm scales by (1 + w): not ours
            targets = [self.augment_norm] + ([self.output.norm] if self.config.output_head == "linear" else [])
            for norm in targets:
                if norm.weight.shape == final.weight.shape:
                    norm.weight.copy_(final.weight)
        src = dict(layers[-1].named_parameters())
        names = {
            "input_layernorm.weight": "input_layernorm.weight",
            "post_attention_layernorm.weight": "post_attention_layernorm.weight",
            "q_proj.weight": "self_attn.q_proj.weight",
            "k_proj.weight": "self_attn.k_proj.weight",
            "v_proj.weight": "self_attn.v_proj.weight",
            "o_proj.weight": "self_attn.o_proj.weight",
            "gate_proj.weight": "mlp.gate_proj.weight",
            "up_proj.weight": "mlp.up_proj.weight",
            "down_proj.weight": "mlp.down_proj.weight",
        }
        if gemma:  # Gemma's RMSNorm scales by (1 + w): its weights do not transfer to ours.
            names = {k: v for k, v in names.items() if "layernorm" not in k}
        copied = False
        for layer in self.augment:
            own = dict(layer.named_parameters())
            for ours, theirs in names.items():
                if theirs in src and src[theirs].shape == own[ours].shape and readable(src[theirs]):
                    own[ours].copy_(dense(src[theirs]))
                    copied = True
        return copied


class ResBlock(nn.Module):
    """Medusa's residual block x + SiLU(Wx + b). As in Medusa, W starts at zero and b at PyTorch's
    default, so a fresh block is close to the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(DraftHeads):
    """Medusa-1 heads (Cai et al., 2024), the baseline Clover is measured against.

    Head i maps the base's last hidden state at t through `medusa_num_layers` residual blocks to the token at t+2+i,
    independently of the tokens drafted before it: every node of a depth draws from the same top-k.
    By default they share the base's lm_head and Clover's draft vocabulary, so that a comparison
    with Clover trained by the same recipe isolates the heads' architecture. With
    `config.own_lm_heads` each head projects to the draft vocabulary with weights of its own,
    initialised from the base's lm_head rows, as in Medusa-1 proper.
    """

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config)
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.medusa_num_layers)))
            for _ in range(config.num_heads)
        )
        if config.own_lm_heads:
            rows = config.draft_vocab_size or config.vocab_size
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, rows, bias=False)
                                          for _ in range(config.num_heads))

    def upgrade_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Heads saved when each had one residual block kept it at `heads.{i}.linear`: now `heads.{i}.0.linear`."""
        old = re.compile(r"heads\.(\d+)\.linear\.(weight|bias)")
        return {(f"heads.{m[1]}.0.linear.{m[2]}" if (m := old.fullmatch(k)) else k): v for k, v in state.items()}

    @torch.no_grad()
    def init_projections(self, lm_head: nn.Module) -> None:
        """Each head's own projection starts as the base's lm_head rows of the draft vocabulary."""
        if not self.config.own_lm_heads:
            return
        rows = self.draft_lm_head(lm_head)
        if rows.bias is not None:
            raise ValueError("own_lm_heads starts from the base's lm_head, which has a bias here; this is not supported")
        for proj in self.lm_heads:
            proj.weight.copy_(rows.weight)

    def head_logits(self, i: int, hidden: torch.Tensor, lm_head: DraftLMHead) -> torch.Tensor:
        if self.config.own_lm_heads:
            return self.lm_heads[i](hidden.to(self.lm_heads[i].weight.dtype))
        return lm_head(hidden)

    def features(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Medusa reads the base's hidden states as they are and keeps no cache."""
        return hidden, None

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Teacher-forced pass, shaped as `CloverHeads.forward`: head i at t = 0..T-2-i predicts x_{t+2+i}.
        Each position is drafted from on its own, so packed examples need no mask."""
        T = hidden.shape[1]
        return [head(hidden[:, : T - 1 - i]) for i, head in enumerate(self.heads) if T - 1 - i > 0]

    @torch.no_grad()
    def draft(
        self,
        feature: torch.Tensor,  # (H,)
        root: torch.Tensor,  # () unused: Medusa's heads do not see the tokens before their own
        tree: "TreeBuffers",
        embed: nn.Module,
        lm_head: DraftLMHead,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft the tree's tokens (num_nodes - 1,): the node of rank r at depth d is head d's r-th
        token; and each token's probability under its head (num_nodes - 1,)."""
        depth = len(tree.levels)
        states = [head(feature) for head in self.heads[:depth]]
        if self.config.own_lm_heads:
            probs = torch.stack([self.head_logits(d, h, lm_head) for d, h in enumerate(states)]).float().softmax(-1)
        else:
            probs = lm_head(torch.stack(states)).float().softmax(-1)  # (D, V'), one product for all heads
        drafted, chances = [], []
        for d, level in enumerate(tree.levels):
            top = probs[d].topk(level.k)
            ids = top.indices if self.draft_token_ids is None else self.draft_token_ids[top.indices]
            drafted.append(ids[level.child_rank])
            chances.append(top.values[level.child_rank])
        return torch.cat(drafted), torch.cat(chances)


def build_heads(config: CloverConfig) -> DraftHeads:
    """Fresh heads of the kind `config.head_type` names."""
    return MedusaHeads(config) if config.head_type == "medusa" else CloverHeads(config)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) index of the packed example each position belongs to: a new one wherever a position is 0."""
    return (position_ids == 0).cumsum(-1)
