"""How linear layers multiply the rows of a forward, chosen by what is faster on the CPU at hand.

A verify forward multiplies a handful of rows (the tree's tokens) by every weight, a prefill a few
hundred: shapes BLAS libraries serve unevenly. On an AVX2-only AMD EPYC in fp32, `F.linear`
(x @ W.T) took 1.6-2x as long for 2-4 rows as for one, while the same product as W @ x.T took
1.1-1.3x. In bf16 there (no native bf16), 16 rows took 11x one row's time and 245 rows 160x, while
converting the weight and the rows to fp32 first took 4x and 25x: one row stays fastest in bf16 (it
reads half the bytes), many rows are far faster computed in fp32. So each form is timed per
machine, per number of rows, on the model's own weight shapes, and used only where it wins.
On an AMD EPYC with AVX-512-bf16, oneDNN (which serves bf16 `F.linear` on such CPUs) took 1.3-2.5x as
long for one row as ATen's own kernel, and plain decoding ran 1.5x faster with the latter; from 2
rows up oneDNN was the faster one. So one row is timed too, and "native" switches oneDNN off for
the product. On an Intel Xeon with AMX, the other way round: oneDNN's blocked layout (below) took
17 ms for one row of all SmolLM2's bf16 weights against 21 by ATen's kernel and 24 by `F.linear`, and
whole one-token forwards ran 31 against 37 ms. Those two (and W @ x.T in float32) are all one row
tries: on the AMD CPU in fp32, timing the weights alone picked W @ x.T for one row in some
calibrations (within noise of F.linear, the same matrix-vector product), while whole one-token
forwards ran 2-7% slower with it; a float32 copy reads twice the bytes one row needs.

Some forms compute from a copy of the weight made once and kept ("weight copies"): oneDNN's blocked
layout of it (what inductor's freezing emits), or a float32 copy of a half-precision weight where the
CPU has no native half-precision products (on the AVX2-only EPYC a bf16 product of 16 rows took 3.5x
that of 16 rows by a kept float32 copy; converting the weight on every product reads and writes 3x its
bytes). The copies take memory, bounded by `WeightCopies.limit`; where a copy is missing or would
not fit, its form computes without one (the same product, more slowly).
Where a bf16 weight converts to float16 without loss (bf16's 8-bit mantissa fits float16's 11 bits;
only magnitudes outside float16's range do not), FBGEMM's float16-weight product computes it in
float32 from a packed float16 copy, reading half the bytes of a float32 copy: on the AVX2-only EPYC,
all of SmolLM2's weights at 1 / 2 / 4 / 8 / 16 rows took 20 / 22 / 26 / 49 / 66 ms this way against
21 / 35 / 61 / 138 / 256 ms by bf16 `F.linear` and 47 / 46 / 65 / 80 ms (2-16 rows) by float32 copies.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from clover_hf.core.hardware import amx_cpu
from clover_hf.core.quantized import plain

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
FLOAT16_SHARE = 0.9  # float16 copies are tried where float16 holds at least this share of the weights exactly
MIN_COPY_COUNTS = 2  # a kind of copy is kept only where chosen at this many row counts up to PACK_ROWS
COPY_GAIN = 0.9  # a form that needs a weight copy must also take at most this share of the best form without one
ONE_ROW_GAIN = 0.8  # at one row a form must take at most this share of F.linear's time (timing weights alone
# misled by a few percent there: whole one-token forwards are what counts)
MAX_ROWS = 256  # forms are timed at 1, 2, 4, ... this many rows; longer inputs take the form chosen here
MIN_GAIN = 0.9  # another form must take at most this share of F.linear's time
SETTLED = 0.5  # a float32 form taking at most this share of F.linear's time is kept for every larger row count
NATIVE_BEHIND = 1.5  # the native form taking this many times F.linear's time is not timed at larger row counts
PAD_ROWS = 8
STREAM_BYTES = 128 << 20  # one row is timed streamed through about this many bytes of weights (and the largest apart)
VERIFY_ROWS = 64  # past this many rows (a prefill), the output embedding is not timed
SLICE_ROWS = 16384  # larger weights are timed on this many of their rows

# row count -> form, keyed by powers of two: a count takes the form of the power of two at or below it
LinearForms = Mapping[int, str]


def _linears(model: nn.Module) -> list[nn.Linear]:
    """Plain nn.Linear layers (exact type: quantized and adapter layers subclass it with forwards of
    their own) with a plain weight (not a quantized tensor subclass, as torchao's `quantize_` puts in)
    and without a forward set on the instance (accelerate's offloading hooks set one)."""
    return [m for m in model.modules() if type(m) is nn.Linear and plain(m.weight) and "forward" not in m.__dict__]


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) as (weight @ x.T).T. Past `PAD_ROWS` rows, x gets zero rows up to a
    multiple of `PAD_ROWS`: on the AVX2 CPU above, 15 rows took 2.4x as long as 16 in this form. One row
    gets a zero row: a matrix-vector product there took 1.25x the two-row matrix product (fp32).
    The output is made contiguous, as F.linear's is: left transposed, the ops after it copied it, and SmolLM2's
    float32 verify forwards of 2 and 4 tokens took 34.6-37.6 ms against 27.0-31.6 (AVX-512-bf16 EPYC)."""
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
    # torch.backends.mkldnn.enabled's own getter and setter (its property costs 0.6 us a product, these 0.1)
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


def make_copy(weight: torch.Tensor, form: str) -> torch.Tensor | None:
    """The copy of `weight` that `form` (one of COPIES) computes from; None for FLOAT16_PACKED where
    float16 does not hold the weight exactly (the product would differ from F.linear's), and for TILED
    where the kernel does not take the weight's shape.

    oneDNN's packing is private torch API (`torch.ops.mkldnn._reorder_linear_weight` and
    `_linear_pointwise`, what inductor's freezing emits for CPU linears); no public API lays a weight out
    once for eager products. Both uses are here and in `_packed_linear`, pinned by tests/test_linears.py."""
    weight = weight.detach()
    if form == TILED:
        return bf16_kernel.tile(weight) if bf16_kernel.fits(weight) else None
    if form == FLOAT16_PACKED:
        return _fp16_pack(weight) if float16_exact(weight) else None
    if form == FLOAT32_COPY:
        return weight.float().contiguous()
    if form == FLOAT32_PACKED:
        weight = weight.float()
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)


def stacked_copy(weights: list[torch.Tensor], form: str) -> torch.Tensor | None:
    """`make_copy` of the weights stacked (one product computes all their outputs); the tiled form lays each out
    straight into the copy (`bf16_kernel.tile`), without the stacked weight in between."""
    if form == TILED and all(bf16_kernel.fits(w) for w in weights):
        return bf16_kernel.tile(*weights)
    return make_copy(torch.cat([w.detach() for w in weights]), form)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def form_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: str,
                copy: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed in `form`; the float32 forms return x's dtype. The forms in
    COPIES compute from `copy` (`make_copy(weight, form)`), or without one where it is None."""
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


class WeightCopies:
    """The weight copies the forms in COPIES compute from: one per layer, made for all layers at once
    (`prepare`) and kept while the layer lives, made again when its weight changes (a training step,
    `.to()`). Holds at most `limit` bytes: past that a layer gets no copy, and its form computes
    without one."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = limit
        self.nbytes = 0
        self._copies: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, torch.Tensor | None, int]] = (
            weakref.WeakKeyDictionary())
        # a group of layers that take one input (`shared_input_groups`), by its first: one copy of their
        # weights stacked, and their biases stacked
        self._fused: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, tuple | None, int]] = weakref.WeakKeyDictionary()
        self.apart: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # first layers of groups seen taking other inputs
        self.stacked: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # layers a stacked copy was made for

    def _recount(self) -> None:
        self.nbytes = sum(entry[2] for entries in (self._copies, self._fused) for entry in entries.values())

    @staticmethod
    def _stamp(layer: nn.Linear, form: str) -> tuple:
        w = layer.weight
        return form, w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape)

    def get(self, layer: nn.Linear, form: str) -> torch.Tensor | None:
        """`layer`'s copy for `form`, where `prepare` made one for its weight as it is now."""
        entry = self._copies.get(layer)
        return entry[1] if entry is not None and entry[0] == self._stamp(layer, form) else None

    def prepare(self, layers: Iterable[nn.Linear], form: str) -> None:
        """Make the layers' copies for `form` that are missing or stale, as many as fit in `limit`
        (largest first), in as many threads as torch computes with: FBGEMM packs in one thread, 1.7 s
        for SmolLM2-135M's weights on the AVX2-only EPYC, 1.2 s in two."""
        # a layer whose weight this form cannot copy keeps its None: not tried again while the weight stays
        todo = [m for m in layers if m not in self._copies or self._copies[m][0] != self._stamp(m, form)]
        for m in todo:
            self._copies.pop(m, None)
        self._recount()  # layers freed since drop out
        fits = []
        for m in sorted(todo, key=lambda m: -m.weight.numel()):
            size = copy_nbytes(m.weight, form)
            if self.nbytes + size <= self.limit:
                fits.append(m)
                self.nbytes += size
        if not fits:
            return
        if len(fits) == 1:  # one layer (as trials make them): no pool to start
            made = [make_copy(fits[0].weight, form)]
        else:
            with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
                made = list(pool.map(lambda m: make_copy(m.weight, form), fits))
        for m, copy in zip(fits, made):
            size = 0 if copy is None else copy_nbytes(m.weight, form)  # None: a weight this form cannot copy
            self._copies[m] = (self._stamp(m, form), copy, size)
            if copy is None:
                self.nbytes -= copy_nbytes(m.weight, form)

    def get_fused(self, group: tuple[nn.Linear, ...], form: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The group's stacked copy for `form` and stacked bias, where `prepare_fused` made them for its weights."""
        entry = self._fused.get(group[0])
        if entry is None or entry[0] != tuple(self._stamp(m, form) for m in group):
            return None
        return entry[1]

    def prepare_fused(self, groups: Iterable[tuple[nn.Linear, ...]], form: str) -> None:
        """Make each group's copy of its layers' weights stacked (one product computes them all), in place
        of the layers' own copies, where missing or stale and while they fit in `limit`."""
        todo = []
        for group in groups:
            stamp = tuple(self._stamp(m, form) for m in group)
            entry = self._fused.get(group[0])
            if entry is not None and entry[0] == stamp:
                continue
            self._fused.pop(group[0], None)
            self.stacked.difference_update(group)
            for m in group:
                self._copies.pop(m, None)
            todo.append((group, stamp))
        self._recount()
        fits = []
        for group, stamp in todo:
            size = sum(copy_nbytes(m.weight, form) for m in group)
            if self.nbytes + size <= self.limit:
                fits.append((group, stamp, size))
                self.nbytes += size
        if not fits:
            return
        with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
            made = list(pool.map(lambda g: stacked_copy([m.weight for m in g[0]], form), fits))
        for (group, stamp, size), copy in zip(fits, made):
            bias = None if group[0].bias is None else torch.cat([m.bias.detach() for m in group])
            self._fused[group[0]] = (stamp, None if copy is None else (copy, bias), 0 if copy is None else size)
            if copy is not None:
                self.stacked.update(group)
        self._recount()

    def prepare_units(self, units: list[tuple[nn.Linear, ...]], form: str) -> None:
        """The copies for `form` of `_units`: one stacked copy per group, the layer's own for a layer
        alone, and for the layers of a group whose stacked copy could not be made. A layer alone keeps
        no stacked copy (a group found taking other inputs is split up)."""
        for unit in units:
            if len(unit) == 1:
                self._fused.pop(unit[0], None)
                self.stacked.discard(unit[0])
        self.prepare_fused([u for u in units if len(u) > 1], form)
        self.prepare([m for u in units if len(u) == 1 or self.get_fused(u, form) is None for m in u], form)

    def discard(self, layer: nn.Linear) -> None:
        """Drop `layer`'s own copy, if it has one."""
        if self._copies.pop(layer, None) is not None:
            self._recount()

    def clear(self) -> None:
        self._copies.clear()
        self._fused.clear()
        self.stacked.clear()
        self.nbytes = 0


def copy_nbytes(weight: torch.Tensor, form: str) -> int:
    """Bytes a copy of `weight` for `form` takes (oneDNN's blocked layout pads little: counted unpadded)."""
    return weight.numel() * {FLOAT32_COPY: 4, FLOAT32_PACKED: 4, FLOAT16_PACKED: 2}.get(form, weight.element_size())


def copies_nbytes(models: Iterable[nn.Module], form: str) -> int:
    """Bytes the copies of all the models' plain linear layers take in `form`."""
    layers = {id(m): m for model in models for m in _linears(model)}.values()
    return sum(copy_nbytes(m.weight, form) for m in layers)


def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN computes `F.linear` for half-precision weights of `dtype` on this CPU (elsewhere
    the native form is F.linear itself: on an AVX2-only CPU torch computes bf16 without oneDNN)."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    if check is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # a torch build without the check: time the form
        return True


def evident_forms(models: Iterable[nn.Module], copy_limit: int) -> LinearForms | None:
    """Forms that need no timing: where torch has no bf16 products on this CPU (it converts bf16 to float32 around
    each one) and `bf16_kernel` is built, the kernel's tiled copies at every row count, where every layer's copy fits
    in `copy_limit` bytes. On the AVX2-only EPYC SmolLM2's decoder products took 11.0 / 11.1 / 13.8 / 30.6 ms there
    at 1 / 2 / 4 / 16 rows against 17.6 / 30.9 / 55.8 / 202 in F.linear (float32 copies read twice the bytes), and
    learning the forms from a first call's products slowed one-token steps to ~34 ms against 13 while they lasted,
    over calls of 18-32 tokens. None elsewhere: the forms are timed."""
    models = list(models)
    layers = [m for model in models for m in _linears(model)]
    if not layers or layers[0].weight.dtype != torch.bfloat16 or layers[0].weight.device.type != "cpu":
        return None
    if onednn_serves(torch.bfloat16) or not bf16_kernel.available() or copies_nbytes(models, TILED) > copy_limit:
        return None
    return {1 << k: TILED for k in range(MAX_ROWS.bit_length())}


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def _streamed_ms(models: list[nn.Module], forms: Iterable[str], reps: int, copies: WeightCopies | None = None
                 ) -> dict[str, float]:
    """Milliseconds of one row through every linear layer of the models in turn, as a one-token forward
    runs them, in each of `forms` (those of COPIES from the layers' copies in `copies`, made there and
    kept for the forms chosen to use; without it, made for the timing alone).

    One row is timed so, not a shape's weight again and again: each product then finds its weight
    where a forward does. On the Intel Xeon with AMX, one weight per shape timed again and again
    took 9.4 ms (ATen's kernel) against 10.6 (oneDNN's blocked layout) over SmolLM2's bf16 shapes;
    streamed through all its layers, 22 against 18 ms, and whole one-token forwards 37 against 31.
    Layers that take one input are timed as the forms run them: from one stacked copy where the form
    uses copies (`linear_forms`), apart where it does not.
    Past STREAM_BYTES of weights, every k-th layer (or group) is timed and its time scaled to all those
    layers' bytes; those of over STREAM_BYTES / 8 (an output embedding) are timed apart, so that one does
    not stand for more than its share. On the Intel Xeon with AMX (SmolLM2, bf16), 128 MiB so (every other
    layer) gave the same ratios between forms as all layers (blocked layout 0.65-0.74 of F.linear's
    time, ATen's kernel 1.05-1.10, against 0.72-0.74 and 0.98-1.09), 64 MiB did not (ATen's 0.62-0.76)."""
    units = _units(models, () if copies is None else copies.apart)

    def nbytes(unit: tuple[nn.Linear, ...]) -> int:
        return sum(m.weight.nbytes for m in unit)

    big = [u for u in units if nbytes(u) > STREAM_BYTES // 8]
    rest = [u for u in units if nbytes(u) <= STREAM_BYTES // 8]
    size = sum(map(nbytes, rest))
    sample = rest[:: max(1, -(-size // STREAM_BYTES))]
    scale = size / max(1, sum(map(nbytes, sample)))
    xs = {u[0].in_features: torch.randn(1, u[0].in_features).to(u[0].weight.dtype) for u in units}
    ms = {}
    for form in forms:
        if form in COPIES and copies is not None:
            copies.prepare_units(units, form)

        def products(unit: tuple[nn.Linear, ...]) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
            """The (weight, copy) of each product one row of `unit` takes in this form."""
            if form not in COPIES:
                return [(m.weight, None) for m in unit]
            if len(unit) > 1:
                stacked = (copies.get_fused(unit, form) or (None,))[0] if copies is not None else make_copy(
                    torch.cat([m.weight.detach() for m in unit]), form)
                if stacked is not None:
                    return [(None, stacked)]
            return [(m.weight, make_copy(m.weight, form) if copies is None else copies.get(m, form)) for m in unit]

        def stream(part: list[tuple[nn.Linear, ...]]) -> float:
            made = [(xs[u[0].in_features], products(u)) for u in part]

            def run():
                for x, pairs in made:
                    for weight, copy in pairs:
                        form_linear(x, weight, None, form, copy)

            return _best_ms(run, reps) if part else 0.0

        ms[form] = scale * stream(sample) + stream(big)
    return ms


def _units(models: list[nn.Module], apart: Iterable[nn.Module] = (), groups: list[tuple[nn.Linear, ...]] | None = None
           ) -> list[tuple[nn.Linear, ...]]:
    """The models' plain linear layers in the order a forward runs them, a `shared_input_groups` group as
    one (but those whose first layer is in `apart`); `groups`: the models' `shared_input_groups`, where known."""
    layers = list({id(m): m for model in models for m in _linears(model)}.values())
    apart = {id(m) for m in apart}
    groups = shared_input_groups(models) if groups is None else groups
    first = {id(g[0]): g for g in groups if id(g[0]) not in apart}
    grouped = {id(m) for g in first.values() for m in g}
    return [first.get(id(m), (m,)) for m in layers if id(m) not in grouped or id(m) in first]


def shape_keys(models: Iterable[nn.Module]) -> dict[int, tuple[tuple[int, ...], bool]]:
    """Each plain linear layer's (by id) weight shape, and whether it is a model's output embedding (timed
    apart: it runs once a forward, on the last rows only in a prefill)."""
    models = list(models)
    vocab = {id(m.get_output_embeddings()) for m in models if hasattr(m, "get_output_embeddings")}
    return {id(m): (tuple(m.weight.shape), id(m) in vocab) for model in models for m in _linears(model)}


def one_row_forms(candidates: list[str], half: bool) -> list[str]:
    """The candidates one row tries: a float32 copy reads more than it saves, and W @ x.T in half precision
    is ATen's slow product."""
    return [form for form in candidates if form in (NATIVE, PACKED, TILED) or (form == TRANSPOSED and not half)]


@torch.no_grad()
def faster_forms(models: Iterable[nn.Module], reps: int = 3, copy_limit: int = 0, copies: WeightCopies | None = None
                 ) -> dict[int, str]:
    """The form faster than F.linear, by at least MIN_GAIN (ONE_ROW_GAIN at one row), over the models'
    linear layers at 1, 2, 4, ... MAX_ROWS rows (each weight shape weighted by how often it occurs; the
    output embedding only up to VERIFY_ROWS); counts where F.linear is fastest are left out.

    Tried: W @ x.T (at one row too, for float32 weights: padded to two rows); for half-precision
    weights ATen's own kernel where oneDNN serves their dtype ("native"), else the float32 forms from
    2 rows; the forms that compute from a weight copy whose copies of every layer fit in `copy_limit`
    bytes (`copy_forms_for`: oneDNN's blocked layout where oneDNN computes the weights' dtype, float16
    copies of half-precision weights float16 holds, else float32 copies), from 2 rows (the blocked
    layout at one row too: it reads no more bytes), where they take at most COPY_GAIN of the best
    form's time without a copy. One kind of copy at most is chosen
    (`_one_kind_of_copy`), so the copies are made once: those one row is timed with are made in
    `copies` where given (at most `copy_limit` bytes), for the forms to use without making them again.
    Once a float32 form takes at most SETTLED of F.linear's time, larger counts keep it untimed; once
    the native form takes NATIVE_BEHIND times it, larger counts skip it (ATen's kernel falls further
    behind oneDNN's with more rows). CPU only: elsewhere, none."""
    models = list(models)
    keys = shape_keys(models)
    shapes = Counter()
    weights = {}
    for model in models:
        for m in _linears(model):
            key, rows = keys[id(m)], m.weight.shape[0]
            # a vocabulary-sized weight is timed on a slice of its rows: the time scales with them
            shapes[key] += rows / min(rows, SLICE_ROWS)
            weights.setdefault(key, m.weight[:SLICE_ROWS])
    if not weights or next(iter(weights.values())).device.type != "cpu":
        return {}
    dtype = next(iter(weights.values())).dtype
    half = dtype in (torch.float16, torch.bfloat16)
    exact = {key: float16_exact(w) for key, w in weights.items()} if FLOAT16_PACKED in copy_forms_for(dtype) else {}
    size = {key: shapes[key] * w.numel() for key, w in weights.items()}  # each timed weight stands for this many elements
    held = sum(size[key] for key, ok in exact.items() if ok) / sum(size.values())
    candidates, copying = _candidates(models, dtype, copy_limit, held)
    # timed on a copy of the shape's first weight (the base's, before its heads'), one float16 holds where it does not
    timed_copies = {(key, form): make_copy(w if form != FLOAT16_PACKED or exact[key] else w.half().to(dtype), form)
                    for key, w in weights.items() for form in copying}
    chosen, timings, settled_at, n = {}, {}, {}, 1
    while n <= MAX_ROWS:
        if n == 1:
            tried = one_row_forms(candidates, half)
        else:
            tried = candidates
        if not tried:
            n *= 2
            continue
        if n == 1:
            if copies is not None:
                copies.limit = copy_limit
            ms = _streamed_ms(models, (LINEAR, *tried), reps, copies)
        else:
            ms = dict.fromkeys((LINEAR, *tried), 0.0)
            for key, weight in weights.items():
                output = key[1]
                if output and n > VERIFY_ROWS:  # a prefill keeps the logits of its last row only
                    continue
                x = torch.randn(n, weight.shape[1]).to(weight.dtype)
                for form in ms:
                    copy = timed_copies.get((key, form))
                    timing = _best_ms(lambda: form_linear(x, weight, None, form, copy), 1 if output else reps)
                    ms[form] += shapes[key] * timing
        timings[n] = ms
        best = min(tried, key=ms.get)
        without = min((f for f in ms if f not in COPIES), key=ms.get)
        if best in COPIES and ms[best] > COPY_GAIN * ms[without]:  # not worth the memory
            best = min((f for f in tried if f not in COPIES), key=ms.get, default=LINEAR)
        if ms[best] < (ONE_ROW_GAIN if n == 1 else MIN_GAIN) * ms[LINEAR]:
            chosen[n] = best
        if NATIVE in ms and ms[NATIVE] >= NATIVE_BEHIND * ms[LINEAR]:
            candidates.remove(NATIVE)
        if best in (FLOAT32, FLOAT32_TRANSPOSED, FLOAT32_COPY, FLOAT32_PACKED, FLOAT16_PACKED) and ms[best] <= SETTLED * ms[LINEAR]:
            # converting the weight is a fixed cost that more rows share further: no need to time them
            # (in bf16 on an AVX2 CPU, the larger row counts took half the timing)
            settled = n
            while n < MAX_ROWS:
                n *= 2
                chosen[n], settled_at[n] = best, settled
            break
        n *= 2
    return _one_kind_of_copy(chosen, timings, settled_at)


def _candidates(models: list[nn.Module], dtype: torch.dtype, copy_limit: int, float16_held: float
                ) -> tuple[list[str], list[str]]:
    """The forms to time for weights of `dtype` besides F.linear, and which of them compute from copies
    (those whose copies of every layer fit in `copy_limit` bytes). `float16_held`: the share of the
    weights float16 holds exactly, as estimated from the timed weight of each shape (each layer is
    checked again when its copy is made)."""
    half = dtype in (torch.float16, torch.bfloat16)
    native = half and onednn_serves(dtype)
    # converting every weight to float32 for each product pays only without half-precision products: on the
    # Intel Xeon with AMX it took 3.5-7x oneDNN's bf16 product at 2-256 rows
    candidates = [TRANSPOSED, FLOAT32, FLOAT32_TRANSPOSED] if half and not native else [TRANSPOSED]
    if native:
        candidates.append(NATIVE)
    copying = [f for f in copy_forms_for(dtype) if copies_nbytes(models, f) <= copy_limit]
    if FLOAT16_PACKED in copying:  # a layer whose weight float16 cannot hold computes without a copy: worth it
        if float16_held < FLOAT16_SHARE:  # only where most weights convert
            copying.remove(FLOAT16_PACKED)
        else:  # float32 copies compute the same float32 products reading twice the bytes: not timed
            copying = [f for f in copying if f not in (FLOAT32_COPY, FLOAT32_PACKED)]
    if {FLOAT32_COPY, FLOAT32_PACKED, FLOAT16_PACKED} & set(copying):  # the same float32 products, converting
        candidates = [f for f in candidates if f not in (FLOAT32, FLOAT32_TRANSPOSED)]  # the weight every time
    return candidates + copying, copying


def _one_kind_of_copy(chosen: dict[int, str], timings: dict[int, dict[str, float]], settled_at: dict[int, int]
                      ) -> dict[int, str]:
    """`chosen` with at most one of the COPIES forms: the one that saved the most time over the row
    counts up to PACK_ROWS it was chosen at (verify forwards, every step; a prefill's many rows come
    once a call), and none unless it was chosen at MIN_COPY_COUNTS of those at least (a copy of
    every weight for one row count's gain is not worth its memory: float32 on the AVX2-only EPYC
    chose oneDNN's packed copies at 8 rows alone). The row counts that chose another take their best
    form of the rest; those of two rows or more where the kept copies were timed faster than the form
    chosen there take them too, their memory being spent already (on the AVX-512-bf16 EPYC, 16 rows had
    kept W @ x.T, timed 11.5 ms against 10.5 for the blocked layout over SmolLM2's shapes, short of
    COPY_GAIN, and 16-token verify forwards then took 42 ms against 22)."""
    kinds = {form for form in chosen.values() if form in COPIES}
    if not kinds:
        return chosen

    def saved(kind: str) -> float:
        return sum(timings[n][LINEAR] - timings[n][kind] for n, form in chosen.items()
                   if form == kind and n in timings and n <= PACK_ROWS)

    keep = max(sorted(kinds), key=saved)
    if sum(form == keep and n <= PACK_ROWS for n, form in chosen.items()) < MIN_COPY_COUNTS:
        keep = None
    out = {}
    for n, form in chosen.items():
        if form in COPIES and form != keep:
            ms = timings[settled_at.get(n, n)]
            form = min((f for f in ms if f != LINEAR and (f not in COPIES or f == keep)), key=ms.get, default=LINEAR)
            if ms[form] >= MIN_GAIN * ms[LINEAR]:
                continue
        out[n] = form
    if keep is not None:  # one row is timed streamed, as forwards run it: its choice stands
        for n, ms in timings.items():
            if n > 1 and keep in ms and ms[keep] < ms[out.get(n, LINEAR)]:
                out[n] = keep
    return out


def copy_forms_for(dtype: torch.dtype) -> list[str]:
    """The forms of COPIES this CPU computes for weights of `dtype`: oneDNN's blocked layout where
    oneDNN computes the dtype (float32; bf16 on CPUs with native bf16), else, for half precision,
    FBGEMM's float16 copies where torch has FBGEMM and a float32 copy (and its blocked layout where
    torch has oneDNN). bf16 weights tiled for `bf16_kernel` come first where it is built, but on CPUs with AMX:
    calls that learn their forms (`form_trials`) try the first kind only."""
    half = dtype in (torch.float16, torch.bfloat16)
    fp16 = [FLOAT16_PACKED] if half and fbgemm_packs() else []
    tiled = [TILED] if dtype == torch.bfloat16 and bf16_kernel.available() else []
    if dtype == torch.float32:
        return [PACKED] if onednn_packs() else []
    if half and onednn_serves(dtype):
        # the blocked layout in the weights' own dtype where oneDNN has it: on the Intel Xeon with AMX,
        # FBGEMM's float16 copies (the same bytes, float32 products) took 1.4x its time at 2 rows and 11x
        # at 256, and packing and timing them was a third of the forms' timing
        packed = [PACKED] if onednn_packs() else fp16
        # with AMX, oneDNN's blocked layout multiplies 1-32 rows in about one row's time (Intel Xeon above): it stays
        # the first kind there, the one calls that learn their forms try
        return packed + tiled if amx_cpu() else tiled + packed
    return tiled + fp16 + [FLOAT32_COPY, *([FLOAT32_PACKED] if onednn_packs() else [])] if half else []


def copy_form(forms: LinearForms) -> str | None:
    """The one form of COPIES `forms` uses, if any."""
    return next((form for form in forms.values() if form in COPIES), None)


# sibling layers a decoder layer calls on one input, by the names transformers' decoders give them
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def shared_input_groups(models: Iterable[nn.Module]) -> list[tuple[nn.Linear, ...]]:
    """Groups of plain sibling linear layers named in SHARED_INPUT, alike in input size, dtype, device
    and bias, whose products one product of their stacked weights computes (in the order named, the
    order a forward calls them). The names only suggest it: `linear_forms` computes a member on its own
    where it is called with another input than the group's first; a module whose class sets `shared_input`
    False (Clover's Attention Decoder) is known to call them on different inputs."""
    plain_layers = {id(m) for model in models for m in _linears(model)}
    groups, seen = [], set()
    for model in models:
        for parent in model.modules():
            if not getattr(type(parent), "shared_input", True):
                continue
            for names in SHARED_INPUT:
                group = tuple(parent._modules.get(name) for name in names)
                if not all(m is not None and id(m) in plain_layers for m in group) or id(group[0]) in seen:
                    continue
                first = group[0]
                alike = all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
                            and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
                            for m in group)
                if alike and len({id(m) for m in group}) == len(group):
                    groups.append(group)
                    seen.add(id(first))
    return groups


class _Stacked:
    """One group's product: its first layer computes every member's output from the stacked copy and
    keeps the others' for them, as long as they are called with that same input. A member called with
    another input (an attention whose keys read other states than its queries) computes on its own,
    and so does the whole group from then on; `apart` remembers it, so later blocks keep the layers'
    own copies. A member called while none of the first layer's outputs is kept (its product ran elsewhere:
    the form trials time a row count's first products apart, and it can settle between a layer's q and k)
    computes on its own without that verdict: taking it for another input had split SmolLM2's groups at
    random in a process's first calls, and with them every later verify forward of the process out of the
    decoder layers' one kernel call (one-token steps ~30% slower)."""

    def __init__(self, group: tuple[nn.Linear, ...], copy: torch.Tensor, bias: torch.Tensor | None,
                 apart: weakref.WeakSet) -> None:
        self.first, self.copy, self.bias, self.apart = group[0], copy, bias, apart
        self.alone = False  # a member took another input: the group computes apart for the rest of the block
        self.sizes = [m.out_features for m in group]
        self.ids = [id(m) for m in group]
        self.input: torch.Tensor | None = None
        self.outputs: dict[int, torch.Tensor] = {}

    def __call__(self, layer: nn.Linear, x: torch.Tensor, form: str) -> torch.Tensor:
        if self.alone:
            return form_linear(x, layer.weight, layer.bias, form)  # without a copy until the next block
        if layer is self.first:
            return self._split(x, form_linear(x, None, self.bias, form, self.copy))
        if x is self.input and id(layer) in self.outputs:
            return self._take(id(layer))
        if self.outputs:  # the first layer's product of another input waits for this member
            self.alone = True
            self.apart.add(self.first)
            self.input, self.outputs = None, {}
        return form_linear(x, layer.weight, layer.bias, form)

    def _split(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The first layer's part of the group's product `out` of `x`; the others' are kept for them."""
        parts = torch.split_with_sizes(out, self.sizes, -1)  # Tensor.split's Python wrapper took ~3 us more a call
        self.input, self.outputs = x, dict(zip(self.ids[1:], parts[1:]))
        return parts[0]

    def _take(self, key: int) -> torch.Tensor:
        """A member's kept output, handed over once; the input is let go with the last."""
        out = self.outputs.pop(key)
        if not self.outputs:
            self.input = None
        return out

    def member(self, layer: nn.Linear, form: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """`layer`'s product in `form`, as `__call__` computes it, with what can be looked up once bound."""
        if layer is self.first:
            compute = form_product(form, None, self.bias, self.copy)
            return lambda x: self(layer, x, form) if self.alone else self._split(x, compute(x))
        key = id(layer)

        def sibling(x: torch.Tensor) -> torch.Tensor:
            if x is self.input and not self.alone and key in self.outputs:
                return self._take(key)
            return self(layer, x, form)

        return sibling


def kernel_weights(layer: nn.Linear, rows: int, sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Within `linear_forms`: the tiled copy (`bf16_kernel.tile`) and float32 bias `layer`'s products of `rows` rows
    compute from, where they hold the outputs of `sizes` (its own, or its stacked group's); else None."""
    ask = getattr(layer.forward, "kernel_weights", None)
    found = ask(rows) if ask is not None else None
    return found[:2] if found is not None and found[2] == sizes else None


def layer_weights(rows: int, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, gate: nn.Linear, up: nn.Linear,
                  down: nn.Linear) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
    """The tiled copies and biases (`kernel_weights`) a Llama-pattern layer's products of `rows` rows compute from, as
    `bf16_kernel.DecoderLayer` takes them: q/k/v stacked, o, gate/up stacked, down; None where any computes otherwise."""
    weights = [kernel_weights(first, rows, [m.out_features for m in group])
               for first, group in ((q, (q, k, v)), (o, (o,)), (gate, (gate, up)), (down, (down,)))]
    return None if any(w is None for w in weights) else weights


class BlockMemo:
    """Weights looked up for a row count (`kernel_weights`, `layer_weights`) within one block of linear forms, which
    binds new forwards: kept for the row counts whose forms hold all block (`steady_rows`), one lookup per form (the
    row counts of a form compute from the same copies), forgotten when another block binds. Drafted steps change
    width every few steps: looking weights up again each time took ~0.25 ms of SmolLM2's 30 layers in situ (AVX2-only
    EPYC), and once per width a call ~0.6 ms (Zen 4 EPYC), ~10 widths a call."""

    def __init__(self) -> None:
        self.forward: Callable | None = None
        self.found: dict[str, object] = {}

    @staticmethod
    def steady_form(forward: Callable, rows: int) -> str | None:
        """The form `rows` rows compute in, within the block that bound `forward`, where it holds all block
        (`steady_rows`); else None."""
        return forward.form_of(rows) if rows <= getattr(forward, "steady_rows", 0) else None

    def get(self, forward: Callable, rows: int, look: Callable[[int], object | None]) -> object | None:
        """What `look(rows)` gives (None: nothing to keep), looked up once per form within the block that bound
        `forward` (a product's forward): `look` must depend on `rows` only through the form the block gives them."""
        form = self.steady_form(forward, rows)
        if form is None:
            return look(rows)
        if forward is not self.forward:
            self.forward, self.found = forward, {}
        value = self.found.get(form)
        if value is None:
            value = look(rows)
            if value is not None:
                self.found[form] = value
        return value


@contextlib.contextmanager
def linear_forms(models: Iterable[nn.Module], forms: LinearForms, copies: WeightCopies | None = None,
                 trials=None) -> Iterator[None]:
    """Within the block, the models' plain nn.Linear layers compute in the form `forms` gives each
    input's row count; forms that compute from a weight copy take it from `copies` (made there as
    the block starts, where missing; without `copies`, or where one would not fit, they compute without one).
    There, layers that take one input (`shared_input_groups`: a decoder layer's q/k/v and gate/up
    projections) compute in one product from a copy of their weights stacked: on the Intel Xeon with
    AMX, SmolLM2's bf16 weights in oneDNN's blocked layout took 13.6-14.6 ms at 1-16 rows in 121
    products against 16.0-16.5 in 211.
    Each layer's copy and each row count's form are looked up once, as the block starts (checking a copy
    against its weight at every product took ~2 ms of a SmolLM2 verify forward on the AVX2 EPYC): the
    weights must not change within the block, as they do not within a `generate` call.
    `trials` (`form_trials.FormTrials`): products of the row counts it has still to learn (or learnt
    within the block) are computed and timed by it instead, and it makes the copies missing."""
    if not forms and trials is None:
        yield
        return
    forms = dict(forms)
    layers = list({id(m): m for model in models for m in _linears(model)}.values())  # a layer listed twice once
    kind = copy_form(forms)
    stacked: dict[int, _Stacked] = {}
    if copies is not None and kind is not None:
        groups = shared_input_groups(models)
        units = _units(models, copies.apart, groups)
        if trials is None or trials.ready():  # ready trials: the forms' copies are made but for layers no call ran
            # yet (Clover's heads, after a first call of one-token steps), which get theirs now, as without trials
            copies.prepare_units(units, kind)
        else:  # the trials make them as the call can afford them, but the layers of a group seen taking other
            # inputs get their own now (else they computed without copies while trials lived: Clover's input
            # decoder's q/k/v in F.linear, 0.27 ms a drafting step on the AVX2-only EPYC); a few small layers
            copies.prepare_units([(m,) for g in groups if g[0] in copies.apart for m in g], kind)
        for group in (u for u in units if len(u) > 1):
            entry = copies.get_fused(group, kind)
            if entry is not None:
                stacked |= dict.fromkeys((id(m) for m in group), _Stacked(group, *entry, copies.apart))
    made = {} if copies is None or kind is None else {id(m): copies.get(m, kind) for m in layers if id(m) not in stacked}
    # trials ready as the block starts stay so, and leave the verify forwards' row counts to the forms: only a
    # prefill's may still be theirs to learn (asking them took ~1 us a product)
    verify_settled = trials is None or trials.ready()

    def product(m: nn.Linear, form: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """How `m` computes in `form` in this block."""
        if form == kind and id(m) in stacked:
            return stacked[id(m)].member(m, form)
        return form_product(form, m.weight, m.bias, made.get(id(m)) if form == kind else None)

    def bind(m: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
        """`m`'s forward in the block, each row count's product looked up once: SmolLM2's verify forwards in situ,
        alternating, took 12.16 against 12.55 ms at one token and 16.84 against 17.21 at eight (AVX-512-bf16 EPYC)."""
        by_rows: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        by_form: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}

        def forward(x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1] if x.dim() >= 2 else 1
            if trials is not None and (rows > PACK_ROWS or not verify_settled) and trials.handles(rows):
                return trials.product(m, x, rows)
            compute = by_rows.get(rows)
            if compute is None:
                form = form_for(forms, rows)
                compute = by_form.get(form)
                if compute is None:
                    compute = by_form[form] = product(m, form)
                by_rows[rows] = compute
            return compute(x)

        biases: dict[int, torch.Tensor] = {}  # float32 copies of the biases handed out, by the bias's id

        def kernel_weights(rows: int) -> tuple[torch.Tensor, torch.Tensor | None, list[int]] | None:
            """The tiled copy (`bf16_kernel.tile`) and bias (float32) `m`'s products of `rows` rows compute from
            here, stacked with its group's where it leads one, and the output sizes of the layers it holds; None
            where they compute otherwise (no copy, a trial, a group computing apart, or a group's other member; past
            PACK_ROWS, another form). A verify forward's row counts take the copy whatever form they settled on: the
            forms were timed product by product, and the kernel's one call for all of a forward's layers (or a
            draft's levels) saves more than any form gained (SmolLM2 on Zen 4, with 2 and 3 rows settled on F.linear:
            a drafting step 3.39 ms in torch against 1.48 in the kernel, a verify forward 10.05 against 9.25)."""
            if (kind != TILED or (rows > PACK_ROWS and form_for(forms, rows) != TILED)
                    or (trials is not None and (rows > PACK_ROWS or not verify_settled) and trials.handles(rows))):
                return None
            group = stacked.get(id(m))
            if group is not None:
                if group.alone or group.first is not m:
                    return None
                copy, bias, sizes = group.copy, group.bias, group.sizes
            else:
                copy, bias, sizes = made.get(id(m)), m.bias, [m.out_features]
            if copy is None:
                return None
            if bias is not None and id(bias) not in biases:
                biases[id(bias)] = bias.detach().float().contiguous()
            return copy, None if bias is None else biases[id(bias)], sizes

        forward.kernel_weights = kernel_weights
        forward.form_of = functools.partial(form_for, forms)  # the form of a row count in this block
        forward.steady_rows = PACK_ROWS if verify_settled else 0  # up to which row count its answer holds all block
        return forward

    for m in layers:
        m.forward = bind(m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward
