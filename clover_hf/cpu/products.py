"""The forms a linear layer's product can take on the CPU: the same F.linear, computed another way.

A verify forward multiplies a handful of rows (the tree's tokens) by every weight, a prefill a few hundred: shapes
BLAS libraries serve unevenly, and which way is fastest depends on the CPU, the dtype and the row count
(`linears.faster_forms` times them; docs/cpu-measurements.md keeps what was measured). The forms:

- "linear": `F.linear` itself; "transposed": the product as W @ x.T, which some BLAS libraries serve better for a
  few rows; "float32" and "float32_transposed": both with weight and rows converted to float32 first, which pays
  where the CPU has no half-precision products (many rows then compute far faster in float32, one row reads half
  the bytes in bf16); "native": `F.linear` with oneDNN switched off, so that ATen's own kernel computes it (oneDNN
  serves one bf16 row slowly on some CPUs, and well from two rows up).
- forms that compute from a copy of the weight made once and kept (`linears.WeightCopies`): oneDNN's blocked
  layout of it ("packed", what inductor's freezing emits), a float32 copy ("float32_copy", used as W @ x.T) and
  its blocked layout ("float32_packed") where the CPU has no half-precision products (converting the weight on
  every product reads and writes three times its bytes), FBGEMM's float16 copy ("float16_packed": a bf16 weight
  converts to float16 without loss where its magnitudes lie within float16's range, and the product, computed in
  float32, reads half the bytes of a float32 copy), and the C kernel's tiled bf16 copy ("tiled"). Where a copy is
  missing, its form computes the same product without one (`WITHOUT_COPY`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from functools import lru_cache

import torch
import torch.nn.functional as F

from . import kernel as bf16_kernel

LINEAR, TRANSPOSED, FLOAT32, FLOAT32_TRANSPOSED, NATIVE = "linear", "transposed", "float32", "float32_transposed", "native"
# forms computed from a copy of the weight made once: oneDNN's blocked layout (in the weight's dtype, where
# oneDNN computes it), a float32 copy used as W @ x.T, a float32 copy in oneDNN's blocked layout, a float16
# copy packed for FBGEMM (of weights float16 holds exactly; computed in float32), a bf16 copy tiled for
# `bf16_kernel` (on x86 CPUs with AVX2 or AVX-512-BF16, where it is built)
PACKED, FLOAT32_COPY, FLOAT32_PACKED, FLOAT16_PACKED, TILED = (
    "packed", "float32_copy", "float32_packed", "float16_packed", "tiled")
COPIES = (PACKED, FLOAT32_COPY, FLOAT32_PACKED, FLOAT16_PACKED, TILED)
# the same product without a copy; a layer float16 cannot hold exactly (some of the heads' tiny weights) takes
# F.linear, which in bf16 is faster than converting the weight to float32 for every product
WITHOUT_COPY = {PACKED: LINEAR, FLOAT32_COPY: FLOAT32_TRANSPOSED, FLOAT32_PACKED: FLOAT32, FLOAT16_PACKED: LINEAR,
                TILED: LINEAR}
FORMS = (LINEAR, TRANSPOSED, FLOAT32, FLOAT32_TRANSPOSED, NATIVE, *COPIES)
PACK_ROWS = 16  # the row count oneDNN lays a packed weight out for (verify forwards of a few to tens of tokens)
MAX_ROWS = 256  # forms are timed at 1, 2, 4, ... this many rows; longer inputs take the form chosen here
PAD_ROWS = 8

# row count -> form, keyed by powers of two: a count takes the form of the power of two at or below it
LinearForms = Mapping[int, str]


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) as (weight @ x.T).T. Past `PAD_ROWS` rows, x gets zero rows up to a
    multiple of `PAD_ROWS`: a row count just short of such a multiple took far longer than the multiple in
    this form. One row gets a zero row: a matrix-vector product was slower than the two-row matrix product.
    The output is made contiguous, as F.linear's is: left transposed, every op after it copied it."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = (-n) % PAD_ROWS if n > PAD_ROWS else 1 if n == 1 else 0
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
    out = torch.mm(weight, rows.t())[:, :n].t().contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


def _upcast(x, weight, bias):
    return x.float(), weight.float(), None if bias is None else bias.float()


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) with oneDNN switched off for the call, so ATen's own kernel computes
    it. The switch is process-wide: a product another thread runs meanwhile also goes without oneDNN.
    Where it is off already (by the user, or by such a product in another thread) it is left alone,
    so two threads cannot leave it off for good."""
    # torch.backends.mkldnn.enabled's own getter and setter: its property costs several times theirs a product
    if not torch._C._get_mkldnn_enabled():
        return F.linear(x, weight, bias)
    torch._C._set_mkldnn_enabled(False)
    try:
        return F.linear(x, weight, bias)
    finally:
        torch._C._set_mkldnn_enabled(True)


def onednn_packs() -> bool:
    """Whether oneDNN can lay weights out once for later products (a CPU torch build with it)."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@lru_cache(maxsize=1)
def fbgemm_packs() -> bool:
    """Whether this torch build computes FBGEMM's float16-weight products (x86 builds)."""
    try:
        _fp16_pack(torch.ones(8, 8))
        return True
    except (RuntimeError, AttributeError):
        return False


def _fp16_pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` packed as float16 for FBGEMM. torch marks `fbgemm_pack_gemm_matrix_fp16` and
    `fbgemm_linear_fp16_weight_fp32_activation` deprecated (no replacement named; they serve
    `torch.ao`'s dynamic float16 linears); both uses are here and in `_fp16_linear`, pinned by
    tests/test_linears.py, and `fbgemm_packs` turns the form off where they are gone. Their one-time
    deprecation warnings are taken here: the user did not call them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.float())
        torch.fbgemm_linear_fp16_weight_fp32_activation(weight.new_zeros(1, weight.shape[1]).float(), packed, None)
    return packed


def _fp16_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.fbgemm_linear_fp16_weight_fp32_activation(x.float(), packed, None if bias is None else bias.float())
    return out.to(x.dtype)


def float16_exact(weight: torch.Tensor) -> bool:
    """Whether float16 holds every element of `weight` exactly (bf16 weights within float16's range do)."""
    return bool((weight.detach().half().to(weight.dtype) == weight.detach()).all())


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def form_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: str,
                copy: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed in `form`; the float32 forms return x's dtype. The forms in
    COPIES compute from `copy` (`linears.make_copy(weight, form)`), or without one where it is None."""
    if form in COPIES:
        if copy is None:
            form = WITHOUT_COPY[form]
        elif form == FLOAT32_COPY:
            return transposed_linear(x.float(), copy, None if bias is None else bias.float()).to(x.dtype)
        elif form == FLOAT32_PACKED:
            return _packed_linear(x.float(), copy, None if bias is None else bias.float()).to(x.dtype)
        elif form == FLOAT16_PACKED:
            return _fp16_linear(x, copy, bias)
        elif form == TILED:
            return bf16_kernel.linear(x, copy, bias)
        else:
            return _packed_linear(x, copy, bias)
    if form == NATIVE:
        return native_linear(x, weight, bias)
    if form == TRANSPOSED:
        return transposed_linear(x, weight, bias)
    if form == FLOAT32:
        return F.linear(*_upcast(x, weight, bias)).to(x.dtype)
    if form == FLOAT32_TRANSPOSED:
        return transposed_linear(*_upcast(x, weight, bias)).to(x.dtype)
    return F.linear(x, weight, bias)


def form_product(form: str, weight: torch.Tensor | None, bias: torch.Tensor | None, copy: torch.Tensor | None = None
                 ) -> Callable[[torch.Tensor], torch.Tensor]:
    """`form_linear(x, weight, bias, form, copy)` as a function of x, its dispatch done once: the forms of nearly
    every product in decoding (ATen's kernel at one row, oneDNN's blocked layout above) call their kernel directly."""
    if form == NATIVE:
        return lambda x: native_linear(x, weight, bias)
    if form == PACKED and copy is not None:
        return lambda x: _packed_linear(x, copy, bias)
    if form == TILED and copy is not None:
        return bf16_kernel.product(copy, bias)
    return lambda x: form_linear(x, weight, bias, form, copy)


def form_for(forms: LinearForms, rows: int) -> str:
    """The form for `rows` rows: that of the largest power of two at or below it (at most MAX_ROWS)."""
    if not forms:
        return LINEAR
    return forms.get(min(1 << (max(rows, 1).bit_length() - 1), MAX_ROWS), LINEAR)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, forms: LinearForms,
           copy_for: Callable[[str], torch.Tensor | None] | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) in the form `forms` gives x's row count: a form that computes from a weight copy
    computes from `copy_for(form)` (this weight is not a layer's, so `WeightCopies` keeps none), or without one."""
    rows = x.numel() // x.shape[-1] if x.dim() >= 2 else 1
    form = form_for(forms, rows)
    return form_linear(x, weight, bias, form, copy_for(form) if copy_for is not None and form in COPIES else None)
