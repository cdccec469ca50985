"""Linear layers in the form measured faster for each row count: same numbers, exact output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from clover_hf import CloverForCausalLM, CostModel, DraftBudget
from clover_hf.backends import FormBook
from clover_hf.cpu.binding import BoundLinear, linear_forms
from clover_hf.cpu.layers import shared_input_groups
from clover_hf.cpu.linears import (
    VERIFY_ROWS,
    WeightCopies,
    copies_nbytes,
    copy_forms_for,
    faster_forms,
    make_copy,
    onednn_serves,
)
from clover_hf.cpu.products import (
    COPIES,
    FORMS,
    MAX_ROWS,
    PAD_ROWS,
    WITHOUT_COPY,
    fbgemm_packs,
    float16_exact,
    form_for,
    form_linear,
    onednn_packs,
    transposed_linear,
)

from .tiny import ARCHS, CrossAttentionProjections, prompt, same, tiny_model

EVERY = {1 << k: "transposed" for k in range(1, MAX_ROWS.bit_length())}  # 2, 4, ... MAX_ROWS
COUNTS = {1, *EVERY}  # the row counts forms are timed at


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16, 31])
def test_transposed_linear_computes_f_linear(rows):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(48, 16), torch.randn(48), torch.randn(1, rows, 16)  # past 8 rows: padded
    out = transposed_linear(x, weight, bias)
    assert out.shape == (1, rows, 48) and torch.allclose(out, F.linear(x, weight, bias), atol=1e-5)
    assert out.is_contiguous()  # as F.linear's: a transposed output made every op after it copy


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_form_computes_f_linear_in_the_input_dtype(form, dtype):
    torch.manual_seed(0)
    weight, bias, x = (t.to(dtype) for t in (torch.randn(48, 16), torch.randn(48), torch.randn(2, 7, 16)))
    out = form_linear(x, weight, bias, form)
    exact = F.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == dtype and out.shape == (2, 7, 48) and out.is_contiguous()
    assert torch.allclose(out.float(), exact, atol=1e-5 if dtype == torch.float32 else 0.1, rtol=1e-2)


def test_a_row_count_takes_the_form_of_the_power_of_two_below_it():
    forms = {2: "transposed", 8: "float32", MAX_ROWS: "float32_transposed"}
    assert [form_for(forms, n) for n in (1, 2, 3, 4, 7, 8, 15, 16)] == (
        ["linear", "transposed", "transposed", "linear", "linear", "float32", "float32", "linear"])
    assert form_for(forms, MAX_ROWS) == form_for(forms, 10 * MAX_ROWS) == "float32_transposed"  # a prefill
    assert form_for({}, 8) == "linear"
    assert form_for({1: "native", **forms}, 1) == "native" and form_for({1: "native"}, 2) == "linear"


def test_the_native_form_switches_onednn_off_for_its_product_only(monkeypatch):
    seen = []
    original = F.linear

    def spy(*args):
        seen.append(torch.backends.mkldnn.enabled)
        if len(seen) == 2:
            raise RuntimeError("a failing product")
        return original(*args)

    monkeypatch.setattr(F, "linear", spy)
    weight, x = torch.randn(8, 4).to(torch.bfloat16), torch.randn(1, 4).to(torch.bfloat16)
    before = torch.backends.mkldnn.enabled
    assert torch.equal(form_linear(x, weight, None, "native"), original(x, weight))
    with pytest.raises(RuntimeError, match="failing"):
        form_linear(x, weight, None, "native")
    form_linear(x, weight, None, "linear")
    assert seen == [False, False, before] and torch.backends.mkldnn.enabled == before  # restored, also on error
    with torch.backends.mkldnn.flags(enabled=False):  # switched off already: left off
        form_linear(x, weight, None, "native")
        assert seen[-1] is False and torch.backends.mkldnn.enabled is False
    assert torch.backends.mkldnn.enabled == before


def test_linear_forms_apply_to_listed_row_counts_and_are_undone():
    model = tiny_model("llama")
    own = model.lm_head.forward = lambda x: F.linear(x, model.lm_head.weight)  # as accelerate's hooks set one
    ids = prompt(3)
    ref = model(ids).logits
    calls = []
    original = torch.mm

    def spy(*args):
        calls.append(args[1].shape)
        return original(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "mm", spy)
        with linear_forms([model], {1 << (ids.shape[1].bit_length() - 1): "transposed"}):
            inside = model(ids).logits
            one = model(ids[:, :1]).logits  # a row count not listed: F.linear
    assert torch.allclose(inside, ref, atol=1e-5) and torch.allclose(one, ref[:, :1], atol=1e-5)
    layers = sum(type(m) is torch.nn.Linear for m in model.modules()) - 1  # all but the lm_head with its own forward
    padded = ids.shape[1] + (-ids.shape[1]) % PAD_ROWS  # past PAD_ROWS rows, zero rows up to a multiple of it
    assert len(calls) == layers and all(shape[1] == padded for shape in calls)  # x.T: (hidden, rows)
    assert model.lm_head.forward is own
    assert all("forward" not in m.__dict__ for m in model.modules() if m is not model.lm_head)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_stays_exact_with_transposed_linears_in_every_verify(arch, monkeypatch):
    import clover_hf.cpu.products as products

    used, native = [], []
    monkeypatch.setattr(products, "transposed_linear", lambda x, *args: used.append(x.shape) or transposed_linear(x, *args))
    monkeypatch.setattr(products, "native_linear", lambda x, *args: native.append(x.shape) or F.linear(x, *args))
    base = tiny_model(arch)
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)  # the whole tree every step
    budget = DraftBudget(costs=costs, forms={1: "native", **EVERY})
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget), ref)
    assert clover.generation_stats.verified_per_step > 2 and len(used) > 0  # verified in the transposed form
    assert len(native) > 0  # one-row products (the heads' first level drafts from one state) in the native form


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_forms_are_measured_on_the_cpu_within_their_bounds(dtype, monkeypatch):
    import clover_hf.cpu.linears as linears

    timed = []
    monkeypatch.setattr(linears, "form_linear", lambda x, w, b, form, copy=None: timed.append((x.shape[0], w.shape, form))
                        or form_linear(x, w, b, form, copy))
    model = tiny_model("llama").to(dtype)
    forms = faster_forms([model], reps=1)  # no memory for weight copies: no form that needs them
    assert set(forms) <= COUNTS and set(forms.values()) <= set(FORMS) - {"linear", *COPIES}
    tried = {form for _, _, form in timed}
    # native: ATen's kernel where oneDNN computes bf16 natively; converting to float32 for each product elsewhere
    half = {"linear", "transposed", "native"} if onednn_serves(dtype) else {"linear", "transposed", "float32",
                                                                            "float32_transposed"}
    assert tried == (half if dtype == torch.bfloat16 else {"linear", "transposed"})
    vocab = model.lm_head.weight.shape
    first, last = min(n for n, _, _ in timed), max(n for n, _, _ in timed)
    if dtype == torch.bfloat16:  # one row: ATen's own kernel where oneDNN would compute it; float32: W @ x.T
        one_row = {"linear", "native"} if "native" in tried else set()
    else:
        one_row = {"linear", "transposed"}
    assert {form for n, _, form in timed if n == 1} == one_row and first == (1 if one_row else 2)
    assert {n for n, shape, _ in timed if shape == vocab} == {n for n in COUNTS if first <= n <= min(VERIFY_ROWS, last)}
    if last < MAX_ROWS:  # a float32 form settled it: every larger count keeps that form
        assert dtype == torch.bfloat16 and forms[last] in ("float32", "float32_transposed")
        assert all(forms[n] == forms[last] for n in EVERY if n > last)
    assert faster_forms([torch.nn.Sequential()]) == {}  # no linear layers: nothing to measure


def _fake_timings(monkeypatch, ms) -> list[tuple[int, str]]:
    """faster_forms times each product as `ms(rows, form)` instead of the clock; returns the (rows, form) timed."""
    import clover_hf.cpu.linears as linears

    timed = []

    def record(x, w, b, form, copy=None):
        assert (copy is not None) == (form in COPIES)  # a copy form is timed with its copy
        timed.append((x.shape[0], form))

    def fake_ms(fn, reps):
        fn()
        return ms(*timed[-1])

    monkeypatch.setattr(linears, "form_linear", record)
    monkeypatch.setattr(linears, "_best_ms", fake_ms)
    monkeypatch.setattr(linears, "make_copy", lambda w, form: w.detach().clone())  # the CPU may have no such copy
    return timed


def test_a_float32_form_twice_as_fast_is_kept_for_larger_row_counts_untimed(monkeypatch):
    """Converting a half weight to float32 is a fixed cost per product: once that form takes at most
    half of F.linear's time, more rows only favour it more, so they are not timed."""
    import clover_hf.cpu.linears as linears

    cost = {"linear": 1.0, "transposed": 1.0, "float32": 0.8, "float32_transposed": 0.9, "native": 1.0}
    # float32 costs 0.8x F.linear at 1-4 rows, 0.4x from 8 rows up
    cost |= dict.fromkeys(COPIES, 1.0)
    timed = _fake_timings(monkeypatch, lambda rows, form: cost[form] * rows * (
        0.5 if form == "float32" and rows >= 8 else 1.0))
    monkeypatch.setattr(linears, "onednn_serves", lambda dtype: False)  # a CPU without bf16 products: float32 forms
    forms = faster_forms([tiny_model("llama").to(torch.bfloat16)])
    assert forms == {n: "float32" for n in COUNTS if n > 1}  # 0.8x F.linear at 2-4 rows: chosen, timed on; 0.4x at 8: settled
    assert max(rows for rows, _ in timed) == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_tries_atens_own_kernel_or_two_row_products(dtype, monkeypatch):
    """At one row a float32 copy of the weight reads more than it saves and a half-precision W @ x.T is
    ATen's slow product: however their timings come out (faster here), one row tries only ATen's own
    kernel (half weights) or W @ x.T padded to two rows (float32), and oneDNN's blocked layout of the
    weight in its own dtype (where oneDNN packs), and takes one only when it saves ONE_ROW_GAIN; from 2
    rows every form is timed."""
    import clover_hf.cpu.linears as linears

    gain = {}

    def ms(rows, form):
        if form == "linear":
            return rows
        return rows * gain.get((rows, form), gain.get(form, gain.get(rows, 0.5)))

    timed = _fake_timings(monkeypatch, ms)
    monkeypatch.setattr(linears, "onednn_serves", lambda d: True)
    monkeypatch.setattr(linears, "onednn_packs", lambda: True)
    monkeypatch.setattr(linears.bf16_kernel, "available", lambda: False)  # tried first where built: see below
    model = tiny_model("llama").to(dtype)
    forms = faster_forms([model], copy_limit=10**9)
    one_row = "native" if dtype == torch.bfloat16 else "transposed"
    assert {form for rows, form in timed if rows == 1} == {"linear", one_row, "packed"}
    assert forms.get(1) == one_row and forms[2] != "linear"
    gain["packed"] = 0.3  # the blocked layout (an Intel CPU with AMX, bf16: 0.7x F.linear at one row)
    forms = faster_forms([model], copy_limit=10**9)
    assert forms[1] == "packed" and forms[2] == "packed"
    assert "packed" not in {form for rows, form in timed if rows == 1 and form != "packed"}
    monkeypatch.setattr(linears, "onednn_packs", lambda: False)  # no oneDNN packing: not tried
    timed.clear()
    forms = faster_forms([model], copy_limit=10**9)
    assert {form for rows, form in timed if rows == 1} == {"linear", one_row}
    gain[1] = gain[1, "packed"] = 0.85  # saves less than ONE_ROW_GAIN asks at one row; enough from 2 rows
    assert 1 not in faster_forms([model], copy_limit=10**9)


def test_the_native_form_is_timed_while_it_keeps_up_with_f_linear(monkeypatch):
    """ATen's own kernel can beat oneDNN's for one bf16 row, never by much for many: once it takes
    NATIVE_BEHIND times F.linear's time, larger row counts do not time it."""
    import clover_hf.cpu.linears as linears

    # native: 0.5x F.linear at one row, 1.2x at 2, 2x from 4 up
    timed = _fake_timings(monkeypatch, lambda rows, form: rows * (
        {1: 0.5, 2: 1.2}.get(rows, 2.0) if form == "native" else 1.0))
    monkeypatch.setattr(linears, "onednn_serves", lambda dtype: True)
    forms = faster_forms([tiny_model("llama").to(torch.bfloat16)])  # no weight copies allowed
    assert forms == {1: "native"}
    assert {rows for rows, form in timed if form == "native"} == {1, 2, 4}
    assert max(rows for rows, _ in timed) == MAX_ROWS
    monkeypatch.setattr(linears, "onednn_serves", lambda dtype: False)  # native would be F.linear itself
    timed.clear()
    assert faster_forms([tiny_model("llama").to(torch.bfloat16)]) == {}
    assert "native" not in {form for _, form in timed}


def test_linear_forms_are_undone_on_error_and_take_a_layer_listed_twice_once():
    model = tiny_model("llama")
    with pytest.raises(RuntimeError, match="stop"):
        with linear_forms([model, model], {2: "transposed"}):
            assert "forward" in model.lm_head.__dict__
            raise RuntimeError("stop")
    assert all("forward" not in m.__dict__ for m in model.modules())


# float16 copies where FBGEMM computes them, also on CPUs that leave them out for oneDNN's faster bf16 products
ALL_COPIES = [(dtype, form) for dtype in (torch.float32, torch.bfloat16) for form in copy_forms_for(dtype)]
ALL_COPIES += [(torch.bfloat16, "float16_packed")] if fbgemm_packs() and "float16_packed" not in copy_forms_for(torch.bfloat16) else []


def test_this_cpu_has_a_weight_copy_for_each_dtype():
    """float32 weights: oneDNN's blocked layout wherever torch has oneDNN; bf16: that, or a float32 copy."""
    assert copy_forms_for(torch.float32) == (["packed"] if torch.backends.mkldnn.is_available() else [])
    bf16 = copy_forms_for(torch.bfloat16)
    assert ("packed" in bf16) == onednn_serves(torch.bfloat16) and ("float32_copy" in bf16) != onednn_serves(torch.bfloat16)
    # float16 copies (float32 products) where FBGEMM has them and oneDNN has no bf16 blocked layout
    assert ("float16_packed" in bf16) == (fbgemm_packs() and "packed" not in bf16)
    assert "float16_packed" not in copy_forms_for(torch.float32)
    assert copy_forms_for(torch.float64) == []


def test_float16_copies_only_of_weights_float16_holds_exactly():
    """bf16 weights within float16's range convert exactly; one that does not gets no float16 copy, and its
    layer computes without one (remembered: not checked again every product)."""
    exact = torch.randn(8, 16).to(torch.bfloat16)
    assert float16_exact(exact) and not float16_exact(exact.float() + 1e-3)  # float32 digits float16 lacks
    inexact = exact.clone()
    inexact[0, 0] = 1e-9  # below float16's smallest subnormal
    assert not float16_exact(inexact) and make_copy(inexact, "float16_packed") is None
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(inexact)
    copies = WeightCopies(limit=10**6)
    copies.prepare([layer], "float16_packed")
    assert copies.get(layer, "float16_packed") is None and copies.nbytes == 0


@pytest.mark.parametrize("dtype,form", ALL_COPIES)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33])
def test_weight_copy_forms_compute_f_linear(dtype, form, rows):
    torch.manual_seed(0)
    weight, bias, x = (t.to(dtype) for t in (torch.randn(48, 16), torch.randn(48), torch.randn(1, rows, 16)))
    copy = make_copy(weight, form)
    out = form_linear(x, weight, bias, form, copy)
    exact = F.linear(x.float(), weight.float(), bias.float())
    assert out.dtype == dtype and out.shape == (1, rows, 48)
    assert torch.allclose(out.float(), exact, atol=1e-5 if dtype == torch.float32 else 0.1, rtol=1e-2)
    # without its copy a form computes the same product another way
    assert torch.equal(form_linear(x, weight, bias, form), form_linear(x, weight, bias, WITHOUT_COPY[form]))


def test_weight_copies_are_made_once_bounded_and_made_again_when_the_weight_changes(monkeypatch):
    import clover_hf.cpu.linears as linears

    made = []
    monkeypatch.setattr(linears, "make_copy", lambda w, form: made.append(form) or w.detach().float().clone())
    a, b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 4)
    copies = WeightCopies(limit=copies_nbytes([a], "float32_copy"))  # room for the larger layer's copy only
    copies.prepare([b, a], "float32_copy")
    first = copies.get(a, "float32_copy")
    assert first is not None and copies.get(b, "float32_copy") is None and copies.nbytes == 16 * 8 * 4
    copies.prepare([b, a], "float32_copy")
    assert copies.get(a, "float32_copy") is first and made == ["float32_copy"]  # kept, not made again
    with torch.no_grad():
        a.weight.add_(1.0)  # a training step: the copy is stale
    assert copies.get(a, "float32_copy") is None
    copies.prepare([a], "float32_copy")
    assert torch.equal(copies.get(a, "float32_copy"), a.weight) and len(made) == 2
    del a
    import gc

    gc.collect()
    copies.prepare([b], "float32_copy")
    assert copies.get(b, "float32_copy") is not None and copies.nbytes == 16 * 4 * 4  # the freed layer's went with it


def test_one_kind_of_weight_copy_is_chosen(monkeypatch):
    """Two kinds of copy would hold the weights twice more: the one that saves most is kept, and the row
    counts that chose the other take their best form without a copy."""
    import clover_hf.cpu.linears as linears

    monkeypatch.setattr(linears, "onednn_serves", lambda d: False)
    monkeypatch.setattr(linears, "onednn_packs", lambda: True)
    monkeypatch.setattr(linears.bf16_kernel, "available", lambda: False)  # float32 copies here
    cost = {"linear": 1.0, "transposed": 0.85, "float32": 0.95, "float32_transposed": 0.95,
            "float32_copy": 0.6, "float32_packed": 0.7}
    # float32_packed is the faster copy at 2-4 rows only; float32_copy from 8 rows up, where it saves more
    _fake_timings(monkeypatch, lambda rows, form: rows * (0.55 if form == "float32_packed" and rows <= 4 else cost[form]))
    model = tiny_model("llama").to(torch.bfloat16)
    forms = faster_forms([model], copy_limit=copies_nbytes([model], "float32_copy"))
    assert forms == {n: "float32_copy" for n in EVERY}
    short = faster_forms([model], copy_limit=copies_nbytes([model], "float32_copy") - 1)  # no room for the copies
    assert short == {n: "transposed" for n in EVERY}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("form", [f for f in COPIES if f in ("float32_copy", "float32_packed")
                                  or (f == "float16_packed" and fbgemm_packs())
                                  or f in copy_forms_for(torch.float32) + copy_forms_for(torch.bfloat16)
                                  and f != "tiled"])  # bf16 weights only: tests/test_bf16_kernel.py
def test_greedy_stays_exact_with_weight_copies_in_every_verify(arch, form, monkeypatch):
    """Each form that computes from a weight copy (from float32 weights here, where greedy output is exact)
    verifies every tree; copies are made once per layer and the output is plain `generate`'s."""
    import clover_hf.cpu.linears as linears

    made = []
    monkeypatch.setattr(linears, "make_copy", lambda w, f: made.append(f) or make_copy(w, f))
    base = tiny_model(arch)
    if form == "float16_packed":  # float32 weights that float16 holds exactly, as bf16 ones
        with torch.no_grad():
            for p in base.parameters():
                p.copy_(p.half().float())
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)  # the whole tree every step
    budget = DraftBudget(costs=costs, forms={n: form for n in EVERY})
    for _ in range(2):
        assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget), ref)
        assert clover.generation_stats.verified_per_step > 2
    layers = {id(m) for model in (base, clover.clover_heads) for m in model.modules() if type(m) is torch.nn.Linear}
    # made once, in the second call too: one per layer, and one more per group of layers stacked into one product
    groups = shared_input_groups([base, clover.clover_heads])
    assert made == [form] * len(made) and 0 < len(made) <= len(layers) + len(groups)
    assert FormBook.of(budget).copies.nbytes > 0


def test_greedy_stays_exact_when_weight_copies_do_not_fit():
    """Memory short: the layers past the limit compute without a copy, the output is still plain `generate`'s."""

    base = tiny_model("llama")
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)
    limit = copies_nbytes([base], "float32_copy") // 3
    for weight_copies in (limit, False):
        budget = DraftBudget(costs=costs, weight_copies=weight_copies, forms={n: "float32_copy" for n in EVERY})
        assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget), ref)
        copies = FormBook.of(budget).copies
        assert copies.nbytes <= limit and (copies.nbytes > 0) == (weight_copies is not False)


def test_a_weight_copy_chosen_at_one_verify_row_count_alone_is_not_kept(monkeypatch):
    """A copy of every weight for the gain at one row count is not worth its memory: that count takes its
    best form without a copy."""
    import clover_hf.cpu.linears as linears

    monkeypatch.setattr(linears, "onednn_packs", lambda: True)
    cost = {"linear": 1.0, "transposed": 0.85, "packed": 0.85}
    _fake_timings(monkeypatch, lambda rows, form: rows * (0.5 if form == "packed" and rows == 8 else cost[form]))
    model = tiny_model("llama")
    limit = copies_nbytes([model], "packed")
    assert faster_forms([model], copy_limit=limit) == {n: "transposed" for n in EVERY}
    cost["packed"] = 0.6  # faster at every count, one row too: kept
    assert faster_forms([model], copy_limit=limit) == {n: "packed" for n in COUNTS}


def test_kept_copies_serve_every_verify_row_count_they_were_timed_faster_at(monkeypatch):
    """Copies kept for some row counts cost no more memory at others: a count where they were faster, but
    short of COPY_GAIN against the best form without one, takes them too (W @ x.T kept at 16 rows had made
    16-token verify forwards far dearer); one row's choice stands."""
    import clover_hf.cpu.linears as linears

    monkeypatch.setattr(linears, "onednn_packs", lambda: True)
    cost = {"linear": 1.0, "transposed": 0.8}
    packed = {1: 0.78, 2: 0.5, 4: 0.5, 8: 0.5}  # from 16 rows: 0.75, within COPY_GAIN of W @ x.T's 0.8
    _fake_timings(monkeypatch, lambda rows, form: rows * (packed.get(rows, 0.75) if form == "packed" else cost[form]))
    model = tiny_model("llama")
    forms = faster_forms([model], copy_limit=copies_nbytes([model], "packed"))
    assert forms == {n: "packed" for n in EVERY} and 1 not in forms  # one row: 0.78 is not ONE_ROW_GAIN's 0.8
    cost["transposed"] = 0.7  # faster than the copies from 16 rows: it keeps those counts
    forms = faster_forms([model], copy_limit=copies_nbytes([model], "packed"))
    assert {n: forms[n] for n in EVERY} == {n: "packed" if n <= 8 else "transposed" for n in EVERY}


def test_float16_copies_are_not_tried_where_float16_holds_few_weights(monkeypatch):
    import clover_hf.cpu.linears as linears

    monkeypatch.setattr(linears, "fbgemm_packs", lambda: True)
    monkeypatch.setattr(linears, "onednn_serves", lambda d: False)
    timed = _fake_timings(monkeypatch, lambda rows, form: rows * (0.5 if form in COPIES else 1.0))
    model = tiny_model("llama").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().to(torch.bfloat16))  # random weights have a few tiny values float16 lacks
    faster_forms([model], copy_limit=10**9)
    assert "float16_packed" in {form for _, form in timed}
    with torch.no_grad():
        for m in model.modules():
            if type(m) is torch.nn.Linear:
                m.weight.mul_(1e-9)  # below float16's smallest subnormal
    timed.clear()
    faster_forms([model], copy_limit=10**9)
    assert "float16_packed" not in {form for _, form in timed} and "float32_copy" in {form for _, form in timed}


def test_each_layers_copy_is_looked_up_once_per_block(monkeypatch):
    """Checking a copy against its weight at every product costs a share of it; the block does it once per layer."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8))
    copies = WeightCopies(limit=1 << 20)
    looked_up = []
    real_get = copies.get
    monkeypatch.setattr(copies, "get", lambda layer, form: looked_up.append(layer) or real_get(layer, form))
    x = torch.randn(3, 16)
    with torch.no_grad(), linear_forms([model], {2: "float32_copy"}, copies):
        for _ in range(4):
            out = model(x)
    assert len(looked_up) == 2  # once per layer, not once per product
    assert torch.allclose(out, torch.nn.Sequential(*model)(x)) and copies.nbytes == (16 * 16 + 16 * 8) * 4


def test_one_row_is_timed_through_every_layer_in_turn(monkeypatch):
    """One weight timed again and again stays in the core's cache, which favoured ATen's kernel at one row
    on an Intel CPU where whole forwards ran faster with oneDNN's blocked layout: one row streams through
    every layer's weight, as a one-token forward does; more rows are timed per shape."""
    import clover_hf.cpu.linears as linears

    monkeypatch.setattr(linears, "onednn_packs", lambda: True)
    monkeypatch.setattr(linears, "onednn_serves", lambda d: True)
    monkeypatch.setattr(linears.bf16_kernel, "available", lambda: False)
    seen = []
    monkeypatch.setattr(linears, "form_linear", lambda x, w, b, form, copy=None: seen.append(
        (x.shape[0], None if w is None else w.data_ptr(), form, copy is not None)))
    monkeypatch.setattr(linears, "make_copy", lambda w, form: w.detach().clone())
    model = tiny_model("llama").to(torch.bfloat16)
    faster_forms([model], reps=1, copy_limit=10**9)
    layers = {m.weight.data_ptr() for m in model.modules() if isinstance(m, torch.nn.Linear)}
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for form in ("linear", "native"):
        assert {ptr for rows, ptr, f, _ in seen if rows == 1 and f == form} == layers
    # from copies, layers that take one input are one product of their stacked copy (no weight of its own)
    grouped = {m.weight.data_ptr() for g in shared_input_groups([model]) for m in g}
    packed = [ptr for rows, ptr, f, _ in seen if rows == 1 and f == "packed"]
    assert set(packed) == (layers - grouped) | {None} and grouped
    assert all(has_copy == (form == "packed") for rows, _, form, has_copy in seen if rows == 1)
    assert len({ptr for rows, ptr, f, _ in seen if rows == 2 and f == "linear"}) == len(shapes) < len(layers)


def test_one_row_streams_through_every_kth_layer_of_a_large_model_scaled_to_all(monkeypatch):
    """Past STREAM_BYTES of weights every k-th layer is timed at one row, and the time is scaled by those
    layers' bytes over the timed ones' (so it stands beside the other row counts' totals); a layer of over
    STREAM_BYTES / 8 (an output embedding) is timed apart, whole, so it counts its own share only."""
    import clover_hf.cpu.linears as linears

    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16, bias=False) for _ in range(24)),
                                torch.nn.Linear(16, 64, bias=False))
    layers = list(model)
    small = layers[0].weight.nbytes
    monkeypatch.setattr(linears, "STREAM_BYTES", 8 * small)  # every third small layer; the last (4x) apart
    seen = []
    monkeypatch.setattr(linears, "form_linear", lambda x, w, b, form, copy=None: seen.append(w.data_ptr()))
    monkeypatch.setattr(linears, "_best_ms", lambda fn, reps: fn() or 1.0)  # 1 ms for each part timed
    ms = linears._streamed_ms([model], ["linear"], reps=1)
    assert seen == [m.weight.data_ptr() for m in layers[0:24:3] + layers[-1:]]
    assert ms["linear"] == pytest.approx(24 / 8 + 1.0)


@pytest.mark.skipif(not onednn_packs(), reason="this torch build has no oneDNN blocked layout")
def test_copies_made_to_time_one_row_are_kept_for_the_forms(monkeypatch):
    """One row is timed through every layer from each layer's blocked-layout copy; given a WeightCopies,
    those copies are made there, so the forms that choose them use them without making them again."""
    import clover_hf.cpu.linears as linears

    made = []
    monkeypatch.setattr(linears, "make_copy", lambda w, f: made.append(f) or make_copy(w, f))
    model = tiny_model("llama")
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    groups = shared_input_groups([model])
    grouped = {id(m) for g in groups for m in g}
    copies = WeightCopies()
    faster_forms([model], reps=1, copy_limit=copies_nbytes([model], "packed"), copies=copies)
    count = made.count("packed")
    assert all(copies.get_fused(g, "packed") is not None for g in groups)
    assert all(copies.get(m, "packed") is not None for m in layers if id(m) not in grouped)
    shapes = {tuple(m.weight.shape) for m in layers}  # more rows are timed on one copy per shape
    assert count == len(layers) - len(grouped) + len(groups) + len(shapes)  # one copy per layer or group
    with linear_forms([model], {1: "packed"}, copies):  # the forms use them
        pass
    assert made.count("packed") == count  # none made again
    short = WeightCopies()  # no room: timed from copies made for the timing alone, none kept
    faster_forms([model], reps=1, copy_limit=0, copies=short)
    assert short.nbytes == 0 and all(short.get(m, "packed") is None for m in layers)


def test_layers_that_take_one_input_are_grouped_by_their_names():
    llama = tiny_model("llama")
    groups = shared_input_groups([llama])
    names = {id(m): n for n, m in llama.named_modules()}
    assert [tuple(names[id(m)].rsplit(".", 1)[1] for m in g) for g in groups] == [
        ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")] * llama.config.num_hidden_layers
    assert shared_input_groups([tiny_model("phi3")]) == []  # its projections are stacked already


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v with biases
def test_stacked_products_compute_each_layer_and_count_one_copy(arch, monkeypatch):
    """With a weight copy chosen, each group of layers that take one input is one product from one copy of
    the stacked weights; the forward's output is F.linear's, and the members keep no copies of their own."""
    import clover_hf.cpu.products as forms_module

    products = []
    monkeypatch.setattr(forms_module, "transposed_linear",
                        lambda x, w, b: products.append(w.shape) or transposed_linear(x, w, b))
    model = tiny_model(arch)
    ids = prompt(9)
    ref = model(ids).logits
    groups = shared_input_groups([model])
    copies = WeightCopies(limit=copies_nbytes([model], "float32_copy"))
    with linear_forms([model], {1: "float32_copy", 8: "float32_copy"}, copies):
        out = model(ids).logits
    assert torch.allclose(out, ref, atol=1e-5)
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert len(products) == len(layers) - sum(len(g) - 1 for g in groups)
    assert (sum(g[0].out_features for g in groups[:1]), groups[0][0].in_features) in products
    assert all(copies.get(m, "float32_copy") is None for g in groups for m in g)
    assert copies.nbytes == copies_nbytes([model], "float32_copy")  # stacked or not, each weight copied once


def test_a_member_called_with_another_input_computes_on_its_own():
    """The names only suggest a shared input: a member given another tensor gets its own product."""

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(8, 4) for _ in range(3))

        def forward(self, x):
            return torch.cat([self.q_proj(x), self.k_proj(x + 1), self.v_proj(x)], dim=-1)

    torch.manual_seed(0)
    model, x = Odd(), torch.randn(3, 8)
    ref = model(x)
    copies = WeightCopies(limit=10**6)
    with linear_forms([model], {1: "float32_copy", 2: "float32_copy"}, copies):
        assert torch.allclose(model(x), ref, atol=1e-6)
        assert torch.allclose(model(x[:1]), ref[:1], atol=1e-6)


def test_a_group_seen_taking_other_inputs_keeps_its_own_copies_from_then_on():
    """Clover's attention decoders name q/k/v like a decoder layer's, but read their keys from other
    states: once a member is called with another input the group computes apart, and the next block
    gives its layers their own copies instead of a stacked one."""

    torch.manual_seed(0)
    model, x, states = CrossAttentionProjections(), torch.randn(2, 8), torch.randn(2, 8)
    ref = model(x, states)
    group = (model.q_proj, model.k_proj, model.v_proj)
    copies = WeightCopies(limit=10**6)
    forms = {1: "float32_copy", 2: "float32_copy"}
    with linear_forms([model], forms, copies):
        assert copies.get_fused(group, "float32_copy") is not None
        assert torch.allclose(model(x, states), ref, atol=1e-6)
        assert torch.allclose(model(x, states), ref, atol=1e-6)  # apart from here on
    assert model.q_proj in copies.apart
    with linear_forms([model], forms, copies):
        assert copies.get_fused(group, "float32_copy") is None
        assert all(copies.get(m, "float32_copy") is not None for m in group)
        assert torch.allclose(model(x, states), ref, atol=1e-6)
    assert copies.nbytes == copies_nbytes([model], "float32_copy")


def test_a_member_called_before_its_groups_first_layer_computes_alone_and_keeps_the_group():
    """A member called while none of its group's first-layer outputs waits (the first's product ran elsewhere, or
    not yet) is no sign of another input: it computes on its own, and the group stays stacked for later calls."""

    torch.manual_seed(0)
    model, x = CrossAttentionProjections(), torch.randn(2, 8)
    group = (model.q_proj, model.k_proj, model.v_proj)
    copies = WeightCopies(limit=10**6)
    with linear_forms([model], {1: "float32_copy", 2: "float32_copy"}, copies):
        alone = model.k_proj(x)  # before q
        together = [m(x) for m in group]
    assert not copies.apart and copies.get_fused(group, "float32_copy") is not None
    assert torch.allclose(alone, F.linear(x, model.k_proj.weight, model.k_proj.bias), atol=1e-6)
    assert all(torch.allclose(out, F.linear(x, m.weight, m.bias), atol=1e-6)
               for m, out in zip(group, together))


def test_a_block_memo_keeps_what_holds_all_block_once_per_form_and_forgets_it_when_another_block_binds():
    """Weights looked up for a row count are kept while the same forwards are bound, for the row counts up to their
    `steady_rows`, once per form (row counts of one form share the lookup); past them, and for nothing found, looked
    up every time; another block's forwards start afresh, and a forward outside a block keeps nothing."""
    from clover_hf.cpu.binding import BlockMemo
    from clover_hf.cpu.products import PACK_ROWS

    layer = torch.nn.Linear(4, 4)
    forms = {1: "transposed", 2: "float32", 4: "float32", 8: "float32_transposed"}
    looked = []
    memo = BlockMemo()

    def look(rows):
        looked.append(rows)
        return None if rows == 1 else [rows]

    with linear_forms([layer], forms):
        forward = layer.forward
        assert isinstance(forward, BoundLinear) and forward.steady_rows == PACK_ROWS
        assert [forward.form_of(n) for n in (1, 3, 4, 8, 16)] == ["transposed", "float32", "float32",
                                                                   "float32_transposed", "linear"]
        assert memo.get(forward, 2, look) == [2] and memo.get(forward, 2, look) == [2]
        assert memo.get(forward, 4, look) == [2] and memo.get(forward, 3, look) == [2]  # the form of 2 rows
        assert memo.get(forward, 8, look) == [8] and memo.get(forward, 8, look) == [8]
        assert memo.get(forward, 1, look) is None and memo.get(forward, 1, look) is None  # nothing found
        assert memo.get(forward, 4 * PACK_ROWS, look) == [64] and memo.get(forward, 64, look) == [64]  # past steady
        assert looked == [2, 8, 1, 1, 64, 64]
    with linear_forms([layer], forms):
        assert memo.get(layer.forward, 2, look) == [2] and memo.get(layer.forward, 2, look) == [2]  # another block
    assert looked == [2, 8, 1, 1, 64, 64, 2]
    assert memo.get(layer.forward, 2, look) == [2] and memo.get(layer.forward, 2, look) == [2]  # no block: none kept
    assert looked == [2, 8, 1, 1, 64, 64, 2, 2, 2]
