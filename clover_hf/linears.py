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
the product. It is the only form one row tries: on that CPU in fp32, timing the weights alone picked
W @ x.T for one row in some calibrations (within noise of F.linear, the same matrix-vector product),
while whole one-token forwards ran 2-7% slower with it.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

LINEAR, TRANSPOSED, FLOAT32, FLOAT32_TRANSPOSED, NATIVE = "linear", "transposed", "float32", "float32_transposed", "native"
FORMS = (LINEAR, TRANSPOSED, FLOAT32, FLOAT32_TRANSPOSED, NATIVE)
MAX_ROWS = 256  # forms are timed at 1, 2, 4, ... this many rows; longer inputs take the form chosen here
MIN_GAIN = 0.9  # another form must take at most this share of F.linear's time
SETTLED = 0.5  # a float32 form taking at most this share of F.linear's time is kept for every larger row count
NATIVE_BEHIND = 1.5  # the native form taking this many times F.linear's time is not timed at larger row counts
PAD_ROWS = 8
VERIFY_ROWS = 64  # past this many rows (a prefill), the output embedding is not timed
SLICE_ROWS = 16384  # larger weights are timed on this many of their rows

# row count -> form, keyed by powers of two: a count takes the form of the power of two at or below it
LinearForms = Mapping[int, str]


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


def _upcast(x, weight, bias):
    return x.float(), weight.float(), None if bias is None else bias.float()


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) with oneDNN switched off for the call, so ATen's own kernel computes
    it. The switch is process-wide: a product another thread runs meanwhile also goes without oneDNN.
    Where it is off already (by the user, or by such a product in another thread) it is left alone,
    so two threads cannot leave it off for good."""
    if not torch.backends.mkldnn.enabled:
        return F.linear(x, weight, bias)
    torch.backends.mkldnn.enabled = False
    try:
        return F.linear(x, weight, bias)
    finally:
        torch.backends.mkldnn.enabled = True


def form_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, form: str) -> torch.Tensor:
    """F.linear(x, weight, bias) computed in `form`; the float32 forms return x's dtype."""
    if form == NATIVE:
        return native_linear(x, weight, bias)
    if form == TRANSPOSED:
        return transposed_linear(x, weight, bias)
    if form == FLOAT32:
        return F.linear(*_upcast(x, weight, bias)).to(x.dtype)
    if form == FLOAT32_TRANSPOSED:
        return transposed_linear(*_upcast(x, weight, bias)).to(x.dtype)
    return F.linear(x, weight, bias)


def form_for(forms: LinearForms, rows: int) -> str:
    """The form for `rows` rows: that of the largest power of two at or below it (at most MAX_ROWS)."""
    if not forms:
        return LINEAR
    return forms.get(min(1 << (max(rows, 1).bit_length() - 1), MAX_ROWS), LINEAR)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, forms: LinearForms) -> torch.Tensor:
    """F.linear(x, weight, bias) in the form `forms` gives x's row count."""
    rows = x.numel() // x.shape[-1] if x.dim() >= 2 else 1
    return form_linear(x, weight, bias, form_for(forms, rows))


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


def _best_ms(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


@torch.no_grad()
def faster_forms(models: Iterable[nn.Module], reps: int = 3) -> dict[int, str]:
    """The form faster than F.linear, by at least MIN_GAIN, over the models' linear layers at 1, 2, 4,
    ... MAX_ROWS rows (each weight shape weighted by how often it occurs; the output embedding only up
    to VERIFY_ROWS); counts where F.linear is fastest are left out. W @ x.T is tried from 2 rows, the
    float32 forms from 2 rows and ATen's own kernel ("native", where oneDNN serves their dtype) for half-precision
    weights. Once a float32 form takes at most SETTLED of F.linear's time, larger counts keep it
    untimed; once the native form takes NATIVE_BEHIND times it, larger counts skip it (ATen's kernel
    falls further behind oneDNN's with more rows). CPU only: elsewhere, none."""
    models = list(models)
    vocab = {id(m.get_output_embeddings()) for m in models if hasattr(m, "get_output_embeddings")}
    shapes = Counter()
    weights = {}
    for model in models:
        for m in _linears(model):
            key, rows = (tuple(m.weight.shape), id(m) in vocab), m.weight.shape[0]
            # a vocabulary-sized weight is timed on a slice of its rows: the time scales with them
            shapes[key] += rows / min(rows, SLICE_ROWS)
            weights[key] = m.weight[:SLICE_ROWS]
    if not weights or next(iter(weights.values())).device.type != "cpu":
        return {}
    dtype = next(iter(weights.values())).dtype
    half = dtype in (torch.float16, torch.bfloat16)
    candidates = [TRANSPOSED, FLOAT32, FLOAT32_TRANSPOSED] if half else [TRANSPOSED]
    if half and onednn_serves(dtype):
        candidates.append(NATIVE)
    chosen, n = {}, 1
    while n <= MAX_ROWS:
        # one row: W @ x.T is the same matrix-vector product as F.linear, and a float32 copy of the weight
        # reads more bytes than it saves; only ATen's own kernel differs
        tried = [form for form in candidates if n > 1 or form == NATIVE]
        if not tried:
            n *= 2
            continue
        ms = dict.fromkeys((LINEAR, *tried), 0.0)
        for (shape, output), weight in weights.items():
            if output and n > VERIFY_ROWS:  # a prefill keeps the logits of its last row only
                continue
            x = torch.randn(n, weight.shape[1]).to(weight.dtype)
            for form in ms:
                timing = _best_ms(lambda: form_linear(x, weight, None, form), 1 if output else reps)
                ms[form] += shapes[shape, output] * timing
        best = min(tried, key=ms.get)
        if ms[best] < MIN_GAIN * ms[LINEAR]:
            chosen[n] = best
        if NATIVE in ms and ms[NATIVE] >= NATIVE_BEHIND * ms[LINEAR]:
            candidates.remove(NATIVE)
        if best in (FLOAT32, FLOAT32_TRANSPOSED) and ms[best] <= SETTLED * ms[LINEAR]:
            # converting the weight is a fixed cost that more rows share further: no need to time them
            # (in bf16 on an AVX2 CPU, the larger row counts took half the timing)
            while n < MAX_ROWS:
                n *= 2
                chosen[n] = best
            break
        n *= 2
    return chosen


@contextlib.contextmanager
def linear_forms(models: Iterable[nn.Module], forms: LinearForms) -> Iterator[None]:
    """Within the block, the models' plain nn.Linear layers compute in the form `forms` gives each
    input's row count."""
    if not forms:
        yield
        return
    forms = dict(forms)

    def forward(self, x):
        return linear(x, self.weight, self.bias, forms)

    layers = list({id(m): m for model in models for m in _linears(model)}.values())  # a layer listed twice once
    for m in layers:
        m.forward = types.MethodType(forward, m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward
