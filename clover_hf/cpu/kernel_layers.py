"""The kernel's norms, activations, attention and decoder layers (`kernels/norms.c`, `attention.c`, `layers.c`):
transformers' RMSNorm (alone or with the residual sum before it), rotary embedding, Clover's cosine gate and SwiGLU's
activation in one call each, the attention of a few query tokens, the keys laid out beside a cache (`KeyLayout`), a
KV cache's compaction (`SlotMover`), and all of these as a whole decoder layer in one call (`DecoderLayer`), several
in one call (`DecoderStack`). In situ each torch op a decoder layer runs took several times its warm time, so every
op folded into one call pays."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from .kernel_library import KERNEL, contiguous
from .kernel_products import TILE


def rms_norm(weight: torch.Tensor, eps: float, module: Callable[[torch.Tensor], torch.Tensor]
             ) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' Llama RMSNorm (weight * bf16(x * rsqrt(mean(x^2) + eps))) of bf16 x, as one call: the module
    runs six ops and two conversions, several times slower. Its sums of squares add in another order than torch's:
    a last bit differs rarely (a few outputs in a million). Other inputs go to `module` (the norm's own forward)."""
    weight = weight.detach().contiguous()
    dim = weight.shape[-1]

    def compute(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != dim:
            return module(x)
        return norm(x, weight, eps)

    return compute


def add_rms_norm(weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor, torch.Tensor], tuple | None]:
    """(a + b, the RMSNorm of it) of bf16 a and b of one shape on the CPU, by `weight`, in one call: a decoder layer's
    residual sum and the norm after it (the sum bitwise torch's; the norm as `rms_norm`'s). The function returns None
    for other inputs."""
    weight = weight.detach().contiguous()
    dim, bf16 = weight.shape[-1], torch.bfloat16

    def compute(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if a.dtype is not bf16 or b.dtype is not bf16 or a.shape != b.shape or a.shape[-1] != dim or not (
                a.is_cpu and b.is_cpu):
            return None
        a, b = contiguous(a), contiguous(b)
        total, out = torch.empty_like(a), torch.empty_like(a)
        KERNEL.lib.bf16_add_rms_norm(a.data_ptr(), b.data_ptr(), total.data_ptr(), weight.data_ptr(), out.data_ptr(),
                                     a.numel() // dim, dim, eps)
        return total, out

    return compute


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * bf16(x * rsqrt(mean(x^2) + eps)) over the last dimension of bf16 x on the CPU, by a contiguous bf16
    `weight` of that size (as `rms_norm` computes it)."""
    rows = x.contiguous()
    out = torch.empty_like(rows)
    dim = weight.shape[-1]
    KERNEL.lib.bf16_rms_norm(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.numel() // dim, dim, eps)
    return out


def rope(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Llama's rotary embedding (x * cos + rotate_half(x) * sin) of bf16 queries and keys (B, T, heads, D) by cos
    and sin (B, T, D), as (B, heads, T, D) each, bitwise as torch's bf16 operations compute it, in one call
    (torch's: eight operations and a copy). None where the inputs' layout is not one it reads: each token's heads
    side by side and its tokens at one stride (a view of a projection's output, or of a stacked product's part)."""
    bf16 = torch.bfloat16
    if query.dtype is not bf16 or key.dtype is not bf16 or cos.dtype is not bf16 or sin.dtype is not bf16:
        return None
    (batch, tokens, heads, dim), (_, _, key_heads, _) = query.shape, key.shape
    q_at, k_at = query.stride(), key.stride()
    if not (key.shape[:2] == query.shape[:2] and key.shape[3] == dim and q_at[3] == k_at[3] == 1
            and q_at[2] == k_at[2] == dim and (batch == 1 or (q_at[0] == tokens * q_at[1] and k_at[0] == tokens * k_at[1]))
            and cos.shape == sin.shape == (batch, tokens, dim)):
        return None
    cos, sin = contiguous(cos), contiguous(sin)
    q_out = torch.empty(batch, heads, tokens, dim, dtype=bf16)
    k_out = torch.empty(batch, key_heads, tokens, dim, dtype=bf16)
    KERNEL.lib.bf16_rope(query.data_ptr(), q_at[1], key.data_ptr(), k_at[1], cos.data_ptr(), sin.data_ptr(),
                         q_out.data_ptr(), k_out.data_ptr(), batch, tokens, heads, key_heads, dim)
    return q_out, k_out


def cosine_gate(h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, eps: float = 1e-8
                ) -> torch.Tensor:
    """h + v * cos(q, k), the cosine taken per head of `heads` over the last dimension's parts, of bf16 tensors of one
    shape on the CPU: Clover's Attention Decoder's gate in one call, where torch ran eight ops. Rounds as torch's
    bf16 ops but for the cosine's sums (float32, another order)."""
    h, q, k, v = (contiguous(t) for t in (h, q, k, v))
    width = h.shape[-1]
    out = torch.empty_like(h)
    KERNEL.lib.bf16_cosine_gate(h.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                                h.numel() // width, heads, width // heads, eps)
    return out


ATTENTION_DIMS = range(32, 257, 32)  # the head sizes `attention` takes


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float,
              causal: bool = False) -> torch.Tensor | None:
    """softmax(scale * query @ key.T + mask) @ value of bf16 queries (B, H, T, D) over keys and values (B, G, K, D),
    each key/value head serving H / G query heads, as (B, T, H, D): for the few query tokens of a verify forward, where
    SDPA's CPU kernel has a larger fixed cost a layer. Scores and softmax are float32; each weight is rounded to bf16
    before it weighs the values (summed in float32), as SDPA's CPU kernel rounds its bf16 product's: most outputs are
    bitwise SDPA's where a head's keys are not split among threads (the AVX-512 build then weighs two keys a
    vdpbf16ps). Both builds split a head's keys among threads where its rows would leave one idle (one token's 3
    key/value heads on 2 threads). The AVX2 build weighs values in blocks of keys that stay in L1; the AVX-512 build
    lays out each head's keys for its bf16 products in registers (not by gathers) and splits that work too.
    `mask`: additive, (B, 1, T, K), bf16 or float32; None where every query sees every key, or with `causal` (no mask)
    where query t sees keys 0..K - T + t, as a prompt's tokens see the text up to their own: each pass over a few
    query rows then reads only the keys its last row sees, about half of a prompt's. None where the inputs are not of
    that form, or no kernel is loaded. Keys and values are read as they lie where each head's slots follow one another
    (a growing cache's views of its stores), else from contiguous copies."""
    batch, heads, tokens, dim = query.shape
    kv, bf16 = key.shape, torch.bfloat16
    if not (len(kv) == 4 and kv == value.shape and kv[0] == batch and kv[3] == dim and heads % kv[1] == 0
            and dim in ATTENTION_DIMS and query.dtype is bf16 and key.dtype is bf16 and value.dtype is bf16
            and query.is_cpu and key.is_cpu and value.is_cpu):
        return None
    length = kv[2]
    if causal and (mask is not None or length < tokens):
        return None
    if mask is not None:
        if mask.dtype not in (bf16, torch.float32) or mask.shape != (batch, 1, tokens, length) or not mask.is_cpu:
            return None
        mask = contiguous(mask)
    query = contiguous(query)  # held while the kernel reads it
    # keys and values as they lie: each head's rows one after another, heads and batch rows at any stride (a growing
    # cache's views of its store)
    if key.stride()[2:] != (dim, 1) or value.stride() != key.stride():
        key, value = key.contiguous(), value.contiguous()
    out = torch.empty(batch, tokens, heads, dim, dtype=bf16)
    mask_at, mask_bf16 = (None, 0) if mask is None else (mask.data_ptr(), int(mask.dtype is bf16))
    failed = KERNEL.lib.bf16_attention(query.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(0), key.stride(1),
                                       mask_at, mask_bf16, int(causal), None, 0, None, out.data_ptr(), batch, heads,
                                       kv[1], tokens, length, dim, scale, torch.get_num_threads())
    if failed > 0:
        raise MemoryError("bf16_kernel: no memory for attention's scores")
    return None if failed else out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """`F.silu(gate) * up` of bf16 tensors of one shape on the CPU, as torch rounds it (silu rounded to bf16, then the
    product) but for e^-x (within 2 ulp of torch's, so a last bit may differ), in one call: a SwiGLU MLP's
    activation, read from the parts of a stacked gate/up product as they lie. None where the kernel is not loaded or
    the inputs are not of that form."""
    if (KERNEL.lib is None or gate.dtype is not torch.bfloat16 or up.dtype is not torch.bfloat16
            or gate.shape != up.shape or not gate.is_cpu or not up.is_cpu or gate.dim() == 0):
        return None
    g_row, u_row = _row_stride(gate), _row_stride(up)
    if g_row is None or u_row is None:
        return None
    width = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=torch.bfloat16)
    KERNEL.lib.bf16_silu_mul(gate.data_ptr(), g_row, up.data_ptr(), u_row, out.data_ptr(),
                             gate.numel() // max(width, 1), width)
    return out


def _row_stride(t: torch.Tensor) -> int | None:
    """The stride between the rows (last dimension) of `t` where they lie at one stride, each contiguous; else None."""
    shape, stride = t.shape, t.stride()
    if shape[-1] > 1 and stride[-1] != 1:
        return None
    row = None
    for i in range(t.dim() - 2, -1, -1):  # inner to outer: each dimension of more than one a multiple of the next
        if shape[i] == 1:
            continue
        if row is None:
            row, span = stride[i], stride[i] * shape[i]
        elif stride[i] != span:
            return None
        else:
            span *= shape[i]
    return shape[-1] if row is None else row


class KeyLayout:
    """A cache layer's keys as the kernel's attention reads them (AVX-512 build: 16 keys' bf16 pairs side by side),
    kept beside its key store and extended as keys are added, with how many slots are laid out (`laid`, which the
    kernel sets): laying out every key again at every forward took much of a one-token forward's attention. The
    kernel lays out again from the slots a forward writes, and from those a forward before it wrote (a
    verify forward's tree, compacted after it); other writers of the store call `written`."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.keys = keys  # the store it is for
        batch, heads, slots, dim = keys.shape
        laid_out = KERNEL.lib is not None and keys.dtype is torch.bfloat16 and keys.is_cpu and keys.dim() == 4
        self.head = KERNEL.lib.bf16_key_layout(slots, dim) if laid_out else 0  # uint32s a head
        # None where the build reads the keys as they lie
        self.words = torch.empty(batch * heads * self.head, dtype=torch.int32) if self.head else None
        self.laid = ctypes.c_int32(0)

    @classmethod
    def of(cls, keys: torch.Tensor, made: "KeyLayout | None") -> "KeyLayout":
        """`made` where it is for the store `keys`, else a new one."""
        return made if made is not None and made.keys is keys else cls(keys)

    def written(self, slot: int) -> None:
        """Keys from `slot` on were written by others than the kernel: laid out again when next read."""
        self.laid.value = min(self.laid.value, slot)


class LayerArgs(ctypes.Structure):
    """The C kernel's `struct layer_args`: a decoder layer's weights, sizes and cache stores."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
                    "norm_in", "qkv", "o", "gate_up", "down", "norm_post", "qkv_bias", "o_bias", "gate_up_bias",
                    "down_bias")),
                *((name, ctypes.c_int) for name in ("D", "Hq", "Hk", "hd", "F")),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("threads", ctypes.c_int),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("kv_row", ctypes.c_long),
                ("kv_head", ctypes.c_long), ("layout", ctypes.c_void_p), ("layout_head", ctypes.c_long),
                ("laid", ctypes.c_void_p)]


class StepArgs(ctypes.Structure):
    """The C kernel's `struct step_args`: what a forward's layers share."""

    _fields_ = [*((name, ctypes.c_void_p) for name in ("x", "cos", "sin", "out")), ("length", ctypes.c_int),
                ("mask", ctypes.c_void_p), *((name, ctypes.c_int) for name in ("mask_bf16", "B", "T", "causal"))]


class DecoderLayer:
    """A Llama-pattern decoder layer (RMSNorm, attention over a growing cache, residual; RMSNorm, SwiGLU MLP,
    residual) of bf16 rows in one call (`bf16_layers`): the same kernel functions the lean layer calls one by one
    (`rms_norm`, the products, `rope`, `attention`, `add_rms_norm`, `silu_mul`), so bitwise its output, without the
    ~20 torch ops and Python calls around them, which in situ took several times their warm time.
    Holds the norms' weights and the sizes; it is given the products' tiled weights (`tile`: the q/k/v and gate/up
    weights stacked, as `linears.linear_forms` keeps them) and the cache's stores (`set_weights`, `set_stores`, or at
    each call). `DecoderStack` runs several in one call."""

    pointed = 0  # how many times any layer's args were pointed at other stores (`set_stores`)

    def __init__(self, norm_in: torch.Tensor, norm_post: torch.Tensor, eps: float, heads: int, key_heads: int,
                 head_dim: int, scale: float) -> None:
        self.args = args = LayerArgs()
        self.norms = tuple(w.detach().contiguous() for w in (norm_in, norm_post))
        args.norm_in, args.norm_post = (w.data_ptr() for w in self.norms)
        args.D, args.Hq, args.Hk, args.hd = norm_in.shape[-1], heads, key_heads, head_dim
        args.eps, args.scale, args.threads = eps, scale, torch.get_num_threads()
        self.tiled: tuple[torch.Tensor, ...] = ()  # the products' weights the args point to, and their float32 biases
        self.biases: tuple[torch.Tensor | None, ...] = ()
        self.stores: tuple[torch.Tensor, ...] = ()  # the cache stores the args point to
        self.alone = DecoderStack([self])  # this layer's calls by itself

    def set_weights(self, weights: list[tuple[torch.Tensor, torch.Tensor | None]]) -> bool:
        """Point the args at these (tiled weight, bias) of the q/k/v, o, gate/up and down products (where they are not
        those already); False where their sizes are not the layer's."""
        if len(weights) == 4 == len(self.tiled) and all(w is t for (w, _), t in zip(weights, self.tiled)):
            return True
        a = self.args
        shapes = [(t.shape[0] * TILE, t.shape[1] * 2) for t, _ in weights]
        width = shapes[2][0] // 2 if len(shapes) == 4 else 0
        if shapes != [((a.Hq + 2 * a.Hk) * a.hd, a.D), (a.D, a.Hq * a.hd), (2 * width, a.D), (a.D, width)] or not all(
                t.dtype is torch.bfloat16 and t.is_cpu and t.is_contiguous() for t, _ in weights):
            self.tiled = ()
            return False
        self.tiled = tuple(t for t, _ in weights)
        self.biases = tuple(None if b is None else b.detach().float().contiguous() for _, b in weights)
        a.qkv, a.o, a.gate_up, a.down = (t.data_ptr() for t in self.tiled)
        a.qkv_bias, a.o_bias, a.gate_up_bias, a.down_bias = (None if b is None else b.data_ptr() for b in self.biases)
        a.F = width
        return True

    def set_stores(self, keys: torch.Tensor, values: torch.Tensor, batch: int, end: int,
                   layout: KeyLayout | None = None) -> bool:
        """Point the args at these cache stores (B, key_heads, slots, head_dim), which must hold `end` slots for
        `batch` rows, and the keys' `layout` beside them (None: laid out at each call); False where they are not of
        that form."""
        if layout is not None and (layout.keys is not keys or layout.words is None):
            layout = None
        if len(self.stores) == 3 and keys is self.stores[0] and values is self.stores[1] and layout is self.stores[2]:
            return end <= keys.shape[2] and keys.shape[0] == batch
        a, bf16 = self.args, torch.bfloat16
        if not (keys.dim() == 4 and keys.shape == values.shape and keys.shape[0] == batch and keys.shape[1] == a.Hk
                and keys.shape[3] == a.hd and end <= keys.shape[2] and keys.dtype is bf16 and values.dtype is bf16
                and keys.is_contiguous() and values.is_contiguous() and keys.is_cpu and values.is_cpu):
            self.stores = ()
            return False
        self.stores = (keys, values, layout)
        DecoderLayer.pointed += 1
        a.keys, a.values, a.kv_row, a.kv_head = keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(1)
        a.layout, a.layout_head, a.laid = ((None, 0, None) if layout is None else
                                           (layout.words.data_ptr(), layout.head, ctypes.addressof(layout.laid)))
        return True

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 weights: list[tuple[torch.Tensor, torch.Tensor | None]], keys: torch.Tensor, values: torch.Tensor,
                 length: int, mask: torch.Tensor | None, layout: KeyLayout | None = None, causal: bool = False
                 ) -> torch.Tensor | None:
        """The layer's output for x (B, T, D), by cos and sin (B, T, head_dim), writing the T new keys and values into
        slots `length` on of the stores `keys` and `values` (B, key_heads, slots, head_dim) (and the keys' `layout`),
        under `mask` (B, 1, T, length + T) additive, or None: one token that sees every key, or with `causal` each
        token the keys up to its own. None (nothing written) where the inputs are not of that form."""
        if x.dim() != 3 or not self.set_weights(weights) or not self.set_stores(keys, values, x.shape[0],
                                                                                 length + x.shape[1], layout):
            return None
        return self.alone(x, cos, sin, length, mask, causal)


class DecoderStack:
    """Decoder layers (`DecoderLayer`s of one size, their weights and stores set) run one after another in one call:
    a forward's Python work per layer, about a fifth of a small model's layer in situ, once."""

    def __init__(self, layers: list[DecoderLayer]) -> None:
        self.layers = layers
        self.pointers = (ctypes.POINTER(LayerArgs) * len(layers))(*(ctypes.pointer(layer.args) for layer in layers))
        self.step = StepArgs()

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, length: int, mask: torch.Tensor | None,
                 causal: bool = False) -> torch.Tensor | None:
        """The layers' output for x (B, T, D) by cos and sin (B, T, head_dim), each writing its T new keys and values
        into its stores from slot `length` on, under `mask` or `causal` (as `DecoderLayer`); None where the inputs are
        not of that form (nothing written)."""
        if x.dim() != 3 or not self.layers:
            return None
        first, step, bf16 = self.layers[0].args, self.step, torch.bfloat16
        batch, tokens = x.shape[0], x.shape[1]
        if not (x.shape[2] == first.D and x.dtype is bf16 and x.is_cpu and x.is_contiguous()
                and cos.shape == sin.shape == (batch, tokens, first.hd) and cos.dtype is bf16 and sin.dtype is bf16):
            return None
        step.causal = 0
        if mask is None:
            if tokens != 1 and not causal:
                return None
            step.mask, step.mask_bf16, step.causal = None, 0, int(tokens > 1)
        else:
            if mask.dtype not in (bf16, torch.float32) or mask.shape != (batch, 1, tokens, length + tokens) or (
                    not mask.is_cpu):
                return None
            mask = contiguous(mask)
            step.mask, step.mask_bf16 = mask.data_ptr(), int(mask.dtype is bf16)
        cos, sin = contiguous(cos), contiguous(sin)
        out = torch.empty_like(x)
        step.x, step.cos, step.sin, step.out = x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr()
        step.length, step.B, step.T = length, batch, tokens
        if KERNEL.lib.bf16_layers(self.pointers, len(self.layers), ctypes.byref(step)):
            raise MemoryError(f"bf16_kernel: no memory for decoder layers of {batch * tokens} rows")
        return out


class SlotMover:
    """A KV cache's compaction after a verify forward in one call (`move_slots`), where torch ran three ops a tensor
    over every layer's keys and values: in each of the tensors (B, H, slots, D) on the CPU, of any dtype, slot src[b, i]
    of row b moves to slot dst + i (sources at or after their destinations, in order). Their addresses and strides
    are read once: a cache's stores stay put until they grow, and reading them all again at every compaction took a
    measurable part of a drafted step."""

    def __init__(self, tensors: list[torch.Tensor], batch: int, heads: int, slot_bytes: int) -> None:
        count = len(tensors)
        self.tensors = tensors  # what the pointers point into
        self.batch, self.heads, self.slot_bytes = batch, heads, slot_bytes
        self.args = ((ctypes.c_void_p * count)(*(t.data_ptr() for t in tensors)),
                     (ctypes.c_long * count)(*(t.stride(0) * t.element_size() for t in tensors)),
                     (ctypes.c_long * count)(*(t.stride(1) * t.element_size() for t in tensors)), count)

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> SlotMover | None:
        """A mover over `tensors`, or None where the kernel is not loaded (it is never built for this alone) or a
        tensor is not laid out with each head's slots one after another."""
        if KERNEL.lib is None or not tensors:
            return None
        batch, heads, _, dim = tensors[0].shape
        slot_bytes = dim * tensors[0].element_size()
        if not all(t.is_cpu and t.shape[0] == batch and t.shape[1] == heads and t.stride()[2:] == (dim, 1)
                   and t.shape[3] * t.element_size() == slot_bytes for t in tensors):
            return None
        return cls(tensors, batch, heads, slot_bytes)

    def __call__(self, src: torch.Tensor, dst: int) -> bool:
        """Move slot src[b, i] of row b to slot dst + i in every tensor (as `move_slots`); False (nothing moved) where
        `src` is not of the tensors' batch."""
        if src.shape[0] != self.batch or not src.is_cpu:
            return False
        src = src.to(torch.int64).contiguous()
        KERNEL.lib.move_slots(*self.args, self.batch, self.heads, self.slot_bytes, src.data_ptr(), src.shape[1], dst)
        return True
