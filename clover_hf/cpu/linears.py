"""Which form each row count's linear products take on the CPU at hand, and the weight copies some compute from.

The forms themselves are in `products`. No form wins everywhere: the same product ran faster as W @ x.T than as
`F.linear` for a few float32 rows on one CPU, bf16 products of many rows ran far faster converted to float32 on
CPUs without native bf16 (while one row stays fastest in bf16: it reads half the bytes), and oneDNN served one bf16
row more slowly than ATen's own kernel on one CPU and faster on another (docs/cpu-measurements.md has the figures).
So each form is timed per machine, per number of rows, on the model's own weight shapes (`faster_forms`), and used
only where it wins; `evident_forms` names the one case that needs no timing.

One row is timed as whole one-token forwards run it: timing each weight alone picked forms for one row that were
within noise of `F.linear` there yet made whole forwards slower, and a float32 copy reads twice the bytes one row
needs. So one row tries only ATen's kernel, oneDNN's blocked layout and the C kernel's tiled copy (and W @ x.T in
float32), streamed through the layers as a forward runs them (`_streamed_ms`).

Some forms compute from a copy of the weight made once and kept (`WeightCopies`): the copies take memory, bounded by
`WeightCopies.limit`; where a copy is missing or would not fit, its form computes without one (the same product,
more slowly).
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from clover_hf.core.hardware import amx_cpu

from . import kernel as bf16_kernel
from .layers import _linears, _units, plain_layers, shape_keys
from .products import (
    COPIES,
    FLOAT16_PACKED,
    FLOAT32,
    FLOAT32_COPY,
    FLOAT32_PACKED,
    FLOAT32_TRANSPOSED,
    LINEAR,
    MAX_ROWS,
    NATIVE,
    PACK_ROWS,
    PACKED,
    TILED,
    TRANSPOSED,
    LinearForms,
    _fp16_pack,
    fbgemm_packs,
    float16_exact,
    form_linear,
    onednn_packs,
)

FLOAT16_SHARE = 0.9  # float16 copies are tried where float16 holds at least this share of the weights exactly
MIN_COPY_COUNTS = 2  # a kind of copy is kept only where chosen at this many row counts up to PACK_ROWS
COPY_GAIN = 0.9  # a form that needs a weight copy must also take at most this share of the best form without one
ONE_ROW_GAIN = 0.8  # at one row a form must take at most this share of F.linear's time (timing weights alone
# misled by a few percent there: whole one-token forwards are what counts)
MIN_GAIN = 0.9  # another form must take at most this share of F.linear's time
SETTLED = 0.5  # a float32 form taking at most this share of F.linear's time is kept for every larger row count
NATIVE_BEHIND = 1.5  # the native form taking this many times F.linear's time is not timed at larger row counts
STREAM_BYTES = 128 << 20  # one row is timed streamed through about this many bytes of weights (and the largest apart)
# forms that convert the weight (or computed from a converted copy): once one is far ahead, more rows stay so
CONVERTING = (FLOAT32, FLOAT32_TRANSPOSED, FLOAT32_COPY, FLOAT32_PACKED, FLOAT16_PACKED)
VERIFY_ROWS = 64  # past this many rows (a prefill), the output embedding is not timed
SLICE_ROWS = 16384  # larger weights are timed on this many of their rows


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
        (largest first), in as many threads as torch computes with (FBGEMM packs in one thread: more threads
        make its copies sooner)."""
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
    return sum(copy_nbytes(m.weight, form) for m in plain_layers(models))


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
    in `copy_limit` bytes. There the tiled copies beat F.linear at every row count by far (float32 copies read
    twice the bytes), and learning the forms from a first call's products slowed its one-token steps several
    times over while they lasted, longer than short calls run. None elsewhere: the forms are timed."""
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
    where a forward does (a weight timed again and again sits in the cache, and ranked the forms the
    other way round from whole one-token forwards on one CPU). Layers that take one input are timed as
    the forms run them: from one stacked copy where the form uses copies (`binding.linear_forms`), apart
    where it does not.
    Past STREAM_BYTES of weights, every k-th layer (or group) is timed and its time scaled to all those
    layers' bytes; those of over STREAM_BYTES / 8 (an output embedding) are timed apart, so that one does
    not stand for more than its share. STREAM_BYTES is the least sample that gave the same ratios between
    the forms as streaming all layers did."""
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
    shapes, weights = _timed_weights(models)
    if not weights or next(iter(weights.values())).device.type != "cpu":
        return {}
    dtype = next(iter(weights.values())).dtype
    half = dtype in (torch.float16, torch.bfloat16)
    exact = {key: float16_exact(w) for key, w in weights.items()} if FLOAT16_PACKED in copy_forms_for(dtype) else {}
    size = {key: shapes[key] * w.numel() for key, w in weights.items()}  # elements each timed weight stands for
    held = sum(size[key] for key, ok in exact.items() if ok) / sum(size.values())
    candidates, copying = _candidates(models, dtype, copy_limit, held)
    # timed on a copy of the shape's first weight (the base's, before its heads'), one float16 holds where it does not
    timed_copies = {(key, form): make_copy(w if form != FLOAT16_PACKED or exact[key] else w.half().to(dtype), form)
                    for key, w in weights.items() for form in copying}
    chosen, timings, settled_at, n = {}, {}, {}, 1
    while n <= MAX_ROWS:
        tried = one_row_forms(candidates, half) if n == 1 else candidates
        if not tried:
            n *= 2
            continue
        if n == 1:
            if copies is not None:
                copies.limit = copy_limit
            ms = _streamed_ms(models, (LINEAR, *tried), reps, copies)
        else:
            ms = _rows_ms(n, shapes, weights, (LINEAR, *tried), timed_copies, reps)
        timings[n] = ms
        best = _best_form(ms, tried)
        if ms[best] < (ONE_ROW_GAIN if n == 1 else MIN_GAIN) * ms[LINEAR]:
            chosen[n] = best
        if NATIVE in ms and ms[NATIVE] >= NATIVE_BEHIND * ms[LINEAR]:
            candidates.remove(NATIVE)
        if best in CONVERTING and ms[best] <= SETTLED * ms[LINEAR]:
            # converting the weight is a fixed cost that more rows share further: no need to time them
            settled = n
            while n < MAX_ROWS:
                n *= 2
                chosen[n], settled_at[n] = best, settled
            break
        n *= 2
    return _one_kind_of_copy(chosen, timings, settled_at)


def _timed_weights(models: list[nn.Module]) -> tuple[Counter, dict[tuple, torch.Tensor]]:
    """How many times each weight shape (`shape_keys`) occurs over the models' plain linear layers, and the weight
    it is timed on: the shape's first (the base's, before its heads'); a vocabulary-sized weight is timed on a slice
    of SLICE_ROWS of its rows and counts as many times more as it has rows past them (the time scales with them)."""
    keys = shape_keys(models)
    shapes = Counter()
    weights = {}
    for model in models:
        for m in _linears(model):
            key, rows = keys[id(m)], m.weight.shape[0]
            shapes[key] += rows / min(rows, SLICE_ROWS)
            weights.setdefault(key, m.weight[:SLICE_ROWS])
    return shapes, weights


def _rows_ms(n: int, shapes: Counter, weights: dict[tuple, torch.Tensor], forms: tuple[str, ...],
             timed_copies: dict[tuple, torch.Tensor | None], reps: int) -> dict[str, float]:
    """Milliseconds of `n` rows through every shape's timed weight in each of `forms` (from `timed_copies` where a
    form computes from a copy), each shape counted as many times as it occurs; the output embedding only up to
    VERIFY_ROWS rows (a prefill keeps the logits of its last row only), and timed once (it is the largest)."""
    ms = dict.fromkeys(forms, 0.0)
    for key, weight in weights.items():
        output = key[1]
        if output and n > VERIFY_ROWS:
            continue
        x = torch.randn(n, weight.shape[1]).to(weight.dtype)
        for form in ms:
            copy = timed_copies.get((key, form))
            timing = _best_ms(lambda: form_linear(x, weight, None, form, copy), 1 if output else reps)
            ms[form] += shapes[key] * timing
    return ms


def _best_form(ms: dict[str, float], tried: list[str]) -> str:
    """The fastest of `tried` by `ms`; one that computes from a copy only where it takes at most COPY_GAIN of the best
    form's time without one (else not worth the memory)."""
    best = min(tried, key=ms.get)
    without = min((f for f in ms if f not in COPIES), key=ms.get)
    if best in COPIES and ms[best] > COPY_GAIN * ms[without]:
        best = min((f for f in tried if f not in COPIES), key=ms.get, default=LINEAR)
    return best


def _candidates(models: list[nn.Module], dtype: torch.dtype, copy_limit: int, float16_held: float
                ) -> tuple[list[str], list[str]]:
    """The forms to time for weights of `dtype` besides F.linear, and which of them compute from copies
    (those whose copies of every layer fit in `copy_limit` bytes). `float16_held`: the share of the
    weights float16 holds exactly, as estimated from the timed weight of each shape (each layer is
    checked again when its copy is made)."""
    half = dtype in (torch.float16, torch.bfloat16)
    native = half and onednn_serves(dtype)
    # converting every weight to float32 for each product pays only without half-precision products: with them,
    # it took several times oneDNN's bf16 product at every row count
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
    every weight for one row count's gain is not worth its memory). The row counts that chose another take
    their best form of the rest; those of two rows or more where the kept copies were timed faster than the
    form chosen there take them too, their memory being spent already (a row count that had kept W @ x.T,
    timed a little slower than the copies but short of COPY_GAIN, ran its verify forwards far slower than
    from the copies, which keep their weights laid out for the kernel)."""
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
        # the blocked layout in the weights' own dtype where oneDNN has it: FBGEMM's float16 copies (the same bytes,
        # float32 products) took longer at every row count, far longer at many, and packing and timing them cost
        # a good share of the forms' timing
        packed = [PACKED] if onednn_packs() else fp16
        # with AMX, oneDNN's blocked layout multiplies a few to tens of rows in about one row's time: it stays the
        # first kind there, the one calls that learn their forms try
        return packed + tiled if amx_cpu() else tiled + packed
    return tiled + fp16 + [FLOAT32_COPY, *([FLOAT32_PACKED] if onednn_packs() else [])] if half else []


def copy_form(forms: LinearForms) -> str | None:
    """The one form of COPIES `forms` uses, if any."""
    return next((form for form in forms.values() if form in COPIES), None)


