"""The compiled bf16 kernels (`bf16_kernel`), AVX-512-BF16 and AVX2 builds: the build itself, the product's
exactness against float64 and its use as the "tiled" linear form, and the fused RMSNorm and rotary embedding."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from clover_hf.backends import FormBook
from clover_hf.cpu import kernel as bf16_kernel
from clover_hf.cpu import kernel_layers, kernel_library
from clover_hf.cpu.binding import linear_forms
from clover_hf.cpu.kernel_library import KERNEL
from clover_hf.cpu.linears import TILED, WeightCopies, form_linear, make_copy
from clover_hf.decode import steps as decoding

from .tiny import patch_kernel, tiny_model

COMPILER = kernel_library._compiler()
needs_kernel = pytest.mark.skipif(not bf16_kernel.cpu_supports() or COMPILER is None,
                                  reason="the CPU has neither AVX2 nor AVX-512-BF16, or there is no C compiler")
FLAGS = kernel_library._cpu_flags()
NEEDS = {"avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}, "avx2": {"avx2", "fma"}}
RUNS = [isa for isa, needs in NEEDS.items() if needs <= FLAGS and COMPILER is not None]  # the builds this CPU runs
# each build: AVX-512-BF16's pair products, AVX2's widened weights
BUILDS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in RUNS, reason=f"the CPU has no {isa}, or no C compiler"))
          for isa in NEEDS]


def _close_to_float64(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`out` is the bf16 rounding of the exact product, give or take float32 summation: within one bf16 step."""
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    step = exact.abs().clamp_min(1e-3) * 2.0 ** -7  # bf16 keeps 8 significant bits
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= step).all()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each build, made once into a folder of its own."""
    folder = tmp_path_factory.mktemp("kernels")
    return lambda isa: kernel_library.load(isa, folder)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 16, 21])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_computes_the_product_to_bf16_rounding(isa, rows, with_bias, built, monkeypatch):
    """Each build at every row count (rows go 14 or 4 at a time, fewer with sums split for more chains), odd
    and even numbers of input pairs, with and without a bias, and inputs of more than two dimensions."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(rows)
    for out_features, in_features in ((96, 64), (32, 6), (64, 10), (64, 200)):
        weight = torch.randn(out_features, in_features, dtype=torch.bfloat16)
        bias = torch.randn(out_features, dtype=torch.bfloat16) if with_bias else None
        x = torch.randn(2, rows, in_features, dtype=torch.bfloat16)
        out = bf16_kernel.linear(x, bf16_kernel.tile(weight), bias)
        _close_to_float64(out, x, weight, bias)
        # a strided input (a slice of a wider tensor) gives the same result as its contiguous copy
        wide = torch.randn(rows, 2 * in_features, dtype=torch.bfloat16)
        assert torch.equal(bf16_kernel.linear(wide[:, ::2], bf16_kernel.tile(weight), bias),
                           bf16_kernel.linear(wide[:, ::2].contiguous(), bf16_kernel.tile(weight), bias))
    with pytest.raises(TypeError, match="bf16 rows"):  # as F.linear refuses mixed dtypes, never a wrong answer
        bf16_kernel.linear(x.float(), bf16_kernel.tile(weight), bias)
    with pytest.raises(RuntimeError, match="cannot multiply"):  # and rows of another size
        bf16_kernel.linear(x[..., :-2], bf16_kernel.tile(weight), bias)


@pytest.mark.parametrize("isa", [build for build in BUILDS if build.values == ("avx2",)])
def test_the_avx2_build_rounds_each_row_alike_whatever_the_number_of_rows(isa, built, monkeypatch):
    """AVX2's sums add in one order at every row count (more than 4 rows go up to 6 a pass over half a tile, a
    chunk of input pairs at a time; a prefill's a block of rows at a time): each row of a product of 1-20 rows, and
    of 450, is bitwise that row's product alone."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    weight = torch.randn(96, 200, dtype=torch.bfloat16)  # 100 input pairs: whole chunks and part of one
    tiled, bias = bf16_kernel.tile(weight), torch.randn(96)
    x = torch.randn(450, 200, dtype=torch.bfloat16)
    alone = torch.cat([bf16_kernel.linear(x[i : i + 1], tiled, bias) for i in range(450)])
    _close_to_float64(alone, x, weight, bias)
    for rows in [*range(2, 21), 450]:
        assert torch.equal(bf16_kernel.linear(x[:rows], tiled, bias), alone[:rows])


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernel_rounds_to_nearest_even_and_keeps_nan_and_inf_as_torch_does(isa, built, monkeypatch):
    """Sums that fall exactly between two bf16 values, overflow and NaN: rounded as torch rounds float32 to bf16."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    one = torch.ones(32, 2, dtype=torch.bfloat16)
    weight = torch.cat([one[:, :1], torch.zeros(32, 1, dtype=torch.bfloat16)], 1)
    x = torch.tensor([[1.0, 0.0], [float("nan"), 0.0], [float("inf"), 0.0], [-3e38, 0.0]], dtype=torch.bfloat16)
    # bias + 1 in float32: exactly halfway for the bf16s of 256 + 1 (rounds down to even) and 258 + 1 (up)
    bias = torch.tensor([256.0, 258.0] * 16)
    out = bf16_kernel.linear(x, bf16_kernel.tile(weight), bias)
    want = (F.linear(x.float(), weight.float()) + bias).to(torch.bfloat16)
    assert out[0, :2].tolist() == [256.0, 260.0]
    assert torch.equal(out.isnan(), want.isnan()) and torch.equal(out.nan_to_num(), want.nan_to_num())


def test_the_tiled_form_copies_only_weights_the_kernel_takes():
    """A multiple of 32 output rows, an even number of inputs, bf16 on the CPU: other weights get no copy,
    and their product computes without one, as F.linear does."""
    assert bf16_kernel.fits(torch.zeros(64, 8, dtype=torch.bfloat16))
    for weight in (torch.zeros(48, 8, dtype=torch.bfloat16), torch.zeros(64, 7, dtype=torch.bfloat16),
                   torch.zeros(64, 8)):
        assert not bf16_kernel.fits(weight)
        assert make_copy(weight, TILED) is None
    weight = torch.randn(48, 8, dtype=torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(form_linear(x, weight, None, TILED, None), F.linear(x, weight))
    tiled = bf16_kernel.tile(torch.arange(64 * 4, dtype=torch.bfloat16).reshape(64, 4))
    assert tiled.shape == (2, 2, 32, 2) and tiled[1, 1, 3].tolist() == [(32 + 3) * 4 + 2, (32 + 3) * 4 + 3]


def test_stacked_and_strided_weights_tile_as_their_contiguous_stack():
    """`tile(a, b, ...)` lays out `torch.cat([a, b, ...])` without making it, and a weight that is not contiguous (or
    starts at an odd offset, so its pairs are not 4-byte values) tiles as its contiguous copy."""
    a, b, c = (torch.randn(rows, 10).to(torch.bfloat16) for rows in (64, 32, 96))
    stacked = bf16_kernel.tile(a, b, c)
    assert stacked.shape == (6, 5, 32, 2) and torch.equal(stacked, bf16_kernel.tile(torch.cat([a, b, c])))
    wide = torch.randn(64, 21).to(torch.bfloat16)
    odd_offset = torch.randn(64 * 10 + 1).to(torch.bfloat16)[1:].view(64, 10)
    for strided in (wide[:, 1:11], wide.t().contiguous().t()[:, :10], odd_offset):
        assert not strided.is_contiguous() or strided.storage_offset() % 2
        assert torch.equal(bf16_kernel.tile(strided), bf16_kernel.tile(strided.contiguous()))
    assert torch.equal(bf16_kernel.tile(a, wide[:32, 1:11]), bf16_kernel.tile(torch.cat([a, wide[:32, 1:11]])))


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_whole_forwards_in_the_tiled_form_match_f_linear(arch, isa, built, monkeypatch):
    """A tiny bf16 model's forwards of 1-16 tokens with every layer in the tiled form, q/k/v (qwen2: with
    biases) and gate/up stacked into one tiled copy, match its forwards in F.linear to bf16 rounding."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    model = tiny_model(arch, dtype=torch.bfloat16)
    copies = WeightCopies(limit=10**9)
    ids = torch.randint(0, 256, (1, 16))
    for n in (1, 2, 5, 16):
        with torch.no_grad():
            want = model(ids[:, :n]).logits.float()
            with linear_forms([model], {1: TILED, 2: TILED, 4: TILED, 8: TILED, 16: TILED}, copies):
                got = model(ids[:, :n]).logits.float()
        assert copies.nbytes > 0 and bool(copies.stacked) == (arch != "phi3")  # phi3's q/k/v come stacked
        assert torch.allclose(got, want, atol=0.05, rtol=0.05), (got - want).abs().max()
    assert not torch.equal(got, torch.zeros_like(got))


def test_where_built_the_kernel_is_the_first_kind_of_copy_for_bf16_weights(monkeypatch):
    """It comes before oneDNN's blocked layout (calls that learn their forms try the first kind only) but on CPUs
    with AMX, one row tries it, and float32 weights never get it."""
    import clover_hf.cpu.linears as linears
    from clover_hf.cpu.form_trials import FormTrials

    monkeypatch.setattr(linears, "onednn_serves", lambda d: True)
    monkeypatch.setattr(linears, "onednn_packs", lambda: True)
    patch_kernel(monkeypatch, "available", lambda: True)
    monkeypatch.setattr(linears, "amx_cpu", lambda: False)
    assert linears.copy_forms_for(torch.bfloat16) == [TILED, "packed"]
    assert linears.copy_forms_for(torch.float32) == ["packed"]
    assert TILED in linears.one_row_forms([TILED, "native", "packed"], half=True)
    model = tiny_model("llama", dtype=torch.bfloat16)
    trials = FormTrials([model], WeightCopies(limit=10**9))
    assert trials.copy_kind == TILED and TILED in trials.candidates[1] and TILED in trials.candidates[8]
    monkeypatch.setattr(linears, "amx_cpu", lambda: True)  # oneDNN's AMX products stay first on an Intel Xeon
    assert linears.copy_forms_for(torch.bfloat16) == ["packed", TILED]
    assert FormTrials([model], WeightCopies(limit=10**9)).copy_kind == "packed"
    monkeypatch.setattr(linears, "amx_cpu", lambda: False)
    monkeypatch.setattr(linears, "onednn_serves", lambda d: False)  # an AVX2-only CPU: torch converts bf16
    assert linears.copy_forms_for(torch.bfloat16)[0] == TILED
    monkeypatch.setattr(linears, "onednn_serves", lambda d: True)
    patch_kernel(monkeypatch, "available", lambda: False)
    assert linears.copy_forms_for(torch.bfloat16) == ["packed"]


@needs_kernel
def test_clover_decodes_with_tiled_verify_forwards(monkeypatch):
    """bf16 Clover with every verify width in the tiled form: tiled copies made once per layer (or stacked
    group) that fits, the products computed by the kernel, whole trees verified, tokens as many as asked."""
    from clover_hf import CloverForCausalLM, CostModel, DraftBudget

    from .tiny import prompt

    calls = []
    real = bf16_kernel.product

    def counted(tiled, bias):
        compute = real(tiled, bias)
        return lambda x: calls.append(x.shape[-2] if x.dim() > 1 else 1) or compute(x)

    patch_kernel(monkeypatch, "product", counted)
    clover = CloverForCausalLM.from_base(tiny_model("llama", dtype=torch.bfloat16), lookup_tokens=3)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)  # the whole tree every step
    budget = DraftBudget(costs=costs, forms={1 << k: TILED for k in range(9)})
    ids = prompt(4)
    # logits kept: the lm_head's product runs each step (greedy choices alone would come from its screen)
    out = clover.generate(ids, max_new_tokens=30, do_sample=False, budget=budget, output_logits=True,
                          return_dict_in_generate=True).sequences
    assert out.shape == (1, ids.shape[1] + 30) and torch.equal(out[:, :ids.shape[1]], ids)
    assert clover.generation_stats.verified_per_step > 2
    assert FormBook.of(budget).copies.nbytes > 0 and max(calls) > 2 and len(calls) > 30


def test_without_a_compiler_the_kernel_is_left_out_with_torchs_kernels_computing(tmp_path, monkeypatch, caplog):
    """A machine with no C compiler (or a build that fails) gets no kernel and no error: the forms do not
    offer it, and the build is not tried again in the process."""
    monkeypatch.setattr(KERNEL, "lib", None)
    monkeypatch.setattr(KERNEL, "failed", False)
    monkeypatch.setattr(KERNEL, "building", None)
    monkeypatch.setattr(kernel_library, "instruction_set", lambda: "avx2")
    monkeypatch.setenv("CLOVER_HF_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    from clover_hf.cpu.linears import copy_forms_for

    with caplog.at_level("INFO", logger="clover_hf.cpu.kernel_library"):
        assert not bf16_kernel.available()
    assert "not built" in caplog.text
    assert not list((tmp_path / "kernels").glob("*"))  # nothing half-written left behind
    assert TILED not in copy_forms_for(torch.bfloat16)
    monkeypatch.delenv("CC")
    assert not bf16_kernel.available()  # not tried again


@needs_kernel
def test_the_kernel_is_built_once_into_the_cache_and_loaded_from_there(tmp_path, monkeypatch):
    from clover_hf.backends import cost_key

    monkeypatch.setattr(KERNEL, "lib", None)
    monkeypatch.setattr(KERNEL, "build_id", None)
    monkeypatch.setattr(KERNEL, "failed", False)
    monkeypatch.setattr(KERNEL, "building", None)
    monkeypatch.setenv("CLOVER_HF_CACHE", str(tmp_path))
    bf16_kernel.prepare()  # in the background, as a model load starts it
    assert bf16_kernel.available()
    made = kernel_library.library_path(bf16_kernel.instruction_set(), tmp_path)
    assert made.exists() and [p.name for p in (tmp_path / "kernels").iterdir()] == [made.name]
    # verify costs are kept per build: a changed kernel learns them again
    digest = made.stem.rsplit("-", 1)[-1]
    assert bf16_kernel.build_id() == digest
    assert cost_key(tiny_model("llama", dtype=torch.bfloat16), torch.device("cpu")).endswith(f"bf16 kernel {digest}")
    stamp = made.stat().st_mtime_ns
    monkeypatch.setattr(KERNEL, "lib", None)
    monkeypatch.setattr(KERNEL, "building", None)
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))  # no compiler needed once built (the name
    monkeypatch.setattr(kernel_library, "library_path", lambda isa, cache_dir=None: made)  # depends on it)
    assert bf16_kernel.available() and made.stat().st_mtime_ns == stamp


def test_the_build_follows_the_cpu_and_what_torch_is_told_to_act_as(monkeypatch):
    monkeypatch.setattr(kernel_library, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw",
                                                                       "avx512vl", "avx512_bf16", "avx512_vnni"}))
    monkeypatch.setattr(kernel_library, "cpu_capability", lambda: "AVX512")
    assert bf16_kernel.instruction_set() == "avx512_bf16"
    monkeypatch.setattr(kernel_library, "cpu_capability", lambda: "AVX2")  # ATEN_CPU_CAPABILITY=avx2
    assert bf16_kernel.instruction_set() == "avx2"
    monkeypatch.setattr(kernel_library, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512vl",
                                                                       "avx512_bf16"}))  # no VNNI
    monkeypatch.setattr(kernel_library, "cpu_capability", lambda: "AVX512")
    assert bf16_kernel.instruction_set() == "avx2"
    monkeypatch.setattr(kernel_library, "_cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))  # no bf16
    monkeypatch.setattr(kernel_library, "cpu_capability", lambda: "AVX512")
    assert bf16_kernel.instruction_set() == "avx2"
    monkeypatch.setattr(kernel_library, "_cpu_flags", lambda: frozenset({"sse4_2"}))
    assert bf16_kernel.instruction_set() is None and not bf16_kernel.cpu_supports()
    monkeypatch.setattr(kernel_library, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    monkeypatch.setenv("CLOVER_HF_KERNEL", "0")
    assert not bf16_kernel.cpu_supports()


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_fused_rms_norm_rounds_as_the_module_but_for_rare_last_bits(arch, isa, built, monkeypatch):
    """transformers' RMSNorm of a decoder layer (and Qwen3's per-head q/k norms) on bf16 rows of many scales."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    layer = tiny_model(arch, dtype=torch.bfloat16).model.layers[0]
    norms = [layer.input_layernorm, *([layer.self_attn.q_norm] if arch == "qwen3" else [])]
    torch.manual_seed(0)
    for norm in norms:
        with torch.no_grad():
            norm.weight.copy_(torch.randn_like(norm.weight) * 0.5 + 1)
        dim = norm.weight.shape[0]
        fused = bf16_kernel.rms_norm(norm.weight, norm.variance_epsilon, norm.forward)
        differ = total = 0
        for rows in (1, 3, 8, 16):
            x = (torch.randn(1, rows, 4, dim) * torch.logspace(-3, 3, rows)[None, :, None, None]).to(torch.bfloat16)
            with torch.no_grad():
                want = norm(x)
            got = fused(x)
            assert got.shape == want.shape and got.dtype == torch.bfloat16
            step = want.float().abs() * 2.0 ** -7  # one bf16 step
            assert ((got.float() - want.float()).abs() <= step).all()
            differ, total = differ + int((got != want).sum()), total + want.numel()
        assert differ <= total // 1000
        x = torch.randn(2, dim)  # float32 rows: the module's own forward
        assert torch.equal(fused(x), norm(x))


@needs_kernel
def test_lean_layers_run_fused_norms_only_where_asked_in_bf16(monkeypatch):
    """With `pack` (a call in Clover's forms) a bf16 model's decoder layers norm, and take their MLP's SiLU times
    up, in one kernel call each; without it, or in float32, they run the modules' own (bitwise plain decoding's)."""
    from clover_hf.base.lean_layers import lean_layers

    made, mixed, summed = [], [], []
    real, real_mix, real_add = bf16_kernel.rms_norm, bf16_kernel.silu_mul, bf16_kernel.add_rms_norm
    patch_kernel(monkeypatch, "rms_norm", lambda w, eps, own: made.append(w.shape) or real(w, eps, own))
    patch_kernel(monkeypatch, "silu_mul", lambda gate, up: mixed.append(gate.shape) or real_mix(gate, up))
    patch_kernel(monkeypatch, "add_rms_norm", lambda w, eps: (
        lambda add: lambda a, b: summed.append(a.shape) or add(a, b))(real_add(w, eps)))
    ids = torch.randint(0, 256, (1, 9))
    for dtype, pack, fused in ((torch.bfloat16, True, 4), (torch.bfloat16, False, 0), (torch.float32, True, 0)):
        made.clear()
        mixed.clear()
        summed.clear()
        model = tiny_model("llama", dtype=dtype)
        with torch.no_grad():
            want = model(ids).logits.float()
            with lean_layers(model, pack=pack) as count:
                got = model(ids).logits.float()
        assert count == 2 and len(made) == fused  # two layers, two norms each
        assert len(mixed) == len(summed) == fused // 2  # an MLP each, and the residual sum before it
        if fused:
            assert torch.allclose(got, want, atol=0.05, rtol=0.05)
        else:
            assert torch.equal(got, want)


@pytest.mark.parametrize("isa", BUILDS)
def test_the_fused_rotary_embedding_is_bitwise_torchs(isa, built, monkeypatch):
    """Queries and keys as a projection's output views them (or as parts of a stacked q/k/v product), 1-16
    tokens, one and two rows: bitwise what torch's bf16 operations give, in the (B, heads, T, D) layout."""
    from clover_hf.base.lean_layers import _rotary_together
    from clover_hf.heads.rope import rope_tables

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    for batch, tokens in ((1, 1), (1, 7), (2, 16)):
        stacked = torch.randn(batch, tokens, (9 + 3 + 3) * 64).to(torch.bfloat16) * 4
        query = stacked[..., : 9 * 64].view(batch, tokens, 9, 64)  # a stacked product's parts: rows 960 apart
        key = stacked[..., 9 * 64 : 12 * 64].view(batch, tokens, 3, 64)
        positions = torch.arange(tokens)[None].expand(batch, -1) + 300 * torch.arange(batch)[:, None]
        cos, sin = (t[:, 0] for t in rope_tables(positions, 64, 10000.0, torch.bfloat16))  # (B, T, D)
        got = bf16_kernel.rope(query, key, cos, sin)
        want = _rotary_together(query, key, cos, sin)
        assert got is not None and all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))
    assert bf16_kernel.rope(query[:, :, ::2], key, cos, sin) is None  # heads not side by side: torch's then


def _attention_in_float64(query, key, value, mask, scale):
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(
        query.double(), key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1),
        attn_mask=None if mask is None else mask.double(), scale=scale).transpose(1, 2)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("mask_dtype", [None, torch.bfloat16, torch.float32])
def test_the_kernels_attention_is_as_close_to_float64_as_sdpas(isa, mask_dtype, built, monkeypatch):
    """Queries of a few tokens over shared key/value heads (GQA, and one head each), key counts that are and are not
    multiples of 8 and 16, more query rows than one pass takes, two rows, head sizes 32-128, additive masks in bf16 and
    float32 (blocked entries at bf16's lowest and at -inf) or none: within what SDPA's bf16 result is of float64. Also
    head sizes of 16 and 48, which a whole decoder layer's call attends with (`DecoderLayer`), though `attention` leaves
    them to SDPA: the AVX-512 build lays out keys 16 pairs at a time."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    monkeypatch.setattr(kernel_layers, "ATTENTION_DIMS", range(16, 257, 16))
    torch.manual_seed(0)
    for batch, heads, kv_heads, tokens, keys, dim in ((1, 9, 3, 1, 150, 64), (1, 9, 3, 8, 151, 64), (1, 9, 3, 20, 300, 64),
                                                      (2, 4, 2, 5, 37, 32), (1, 8, 8, 3, 17, 128), (1, 2, 1, 1, 1, 64),
                                                      (1, 4, 2, 3, 150, 16), (1, 9, 3, 1, 200, 48)):
        query = torch.randn(batch, heads, tokens, dim).to(torch.bfloat16)
        key, value = (torch.randn(batch, kv_heads, keys, dim).to(torch.bfloat16) for _ in range(2))
        mask = None
        if mask_dtype is not None:
            seen = torch.rand(batch, 1, tokens, keys) > 0.3
            seen[..., -1] = True  # every query sees a key (a tree node sees itself)
            mask = torch.zeros(batch, 1, tokens, keys, dtype=mask_dtype).masked_fill(~seen, torch.finfo(mask_dtype).min)
            mask[..., 0] = mask[..., 0].masked_fill(~seen[..., 0], float("-inf"))
        scale = dim**-0.5
        got = bf16_kernel.attention(query, key, value, mask, scale)
        exact = _attention_in_float64(query, key, value, mask, scale)
        sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                              enable_gqa=True).transpose(1, 2)
        assert got is not None and got.shape == exact.shape and got.dtype == torch.bfloat16
        assert (got.double() - exact).abs().max() <= 1.5 * (sdpa.double() - exact).abs().max() + 1e-3


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernels_attention_split_among_threads_is_as_close_to_float64(isa, built, monkeypatch):
    """Where a head's rows are fewer than the threads could share (one token's few key/value heads), each build
    splits their keys among threads (the AVX-512 build at multiples of 16 keys) and merges the parts: two to eight parts, a part whose keys are all masked,
    rows in blocks of 4 and fewer; as close to float64 as one thread's single pass, and within a bf16 step of it."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for batch, heads, kv_heads, tokens, keys in ((1, 9, 3, 1, 300), (1, 2, 1, 1, 520), (1, 6, 1, 2, 200),
                                                     (1, 9, 3, 4, 1500)):
            query = torch.randn(batch, heads, tokens, 64).to(torch.bfloat16)
            key, value = (torch.randn(batch, kv_heads, keys, 64).to(torch.bfloat16) for _ in range(2))
            mask = torch.zeros(batch, 1, tokens, keys, dtype=torch.bfloat16)
            mask[..., : keys * 2 // 3] = float("-inf")  # the first parts' keys all masked
            mask[..., 0, 5] = 0.0
            torch.set_num_threads(1)
            one = bf16_kernel.attention(query, key, value, mask, 0.125)
            torch.set_num_threads(8)
            split = bf16_kernel.attention(query, key, value, mask, 0.125)
            exact = _attention_in_float64(query, key, value, mask, 0.125)
            assert (split.double() - exact).abs().max() <= 1.5 * (one.double() - exact).abs().max() + 1e-3
            assert torch.allclose(split.float(), one.float(), rtol=2**-7, atol=1e-3)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernels_attention_reads_keys_and_values_as_views_of_a_larger_cache(isa, built, monkeypatch):
    """Keys and values that are the first slots of larger tensors (a growing cache's views of its stores: heads and
    batch rows further apart than the slots used) attend bitwise as their contiguous copies; other layouts are
    copied first."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    query = torch.randn(2, 6, 3, 64).to(torch.bfloat16)
    stores = [torch.randn(2, 3, 90, 64).to(torch.bfloat16) for _ in range(2)]
    key, value = (store[:, :, :41] for store in stores)
    mask = torch.zeros(2, 1, 3, 41, dtype=torch.bfloat16)
    want = bf16_kernel.attention(query, key.contiguous(), value.contiguous(), mask, 0.125)
    assert not key.is_contiguous() and torch.equal(bf16_kernel.attention(query, key, value, mask, 0.125), want)
    turned = [t.transpose(2, 3).contiguous().transpose(2, 3) for t in (key, value)]  # each slot's values apart
    assert torch.equal(bf16_kernel.attention(query, *turned, mask, 0.125), want)


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernels_attention_rounds_its_weights_to_bf16_as_sdpa_does(isa, built, monkeypatch):
    """The softmax's weights are rounded to bf16 before they weigh the values, as SDPA's CPU kernel rounds them for
    its bf16 product: most outputs are bitwise SDPA's (with float32 weights ~60% were), no further from float64's than
    SDPA's, for head sizes of whole and half blocks of 32 (the AVX-512 build weighs two keys at a time) and an odd
    number of keys. On one thread: threads that split a head's keys weigh each part's values against its own largest
    score, as SDPA does only past its blocks of keys."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    monkeypatch.setattr(kernel_layers, "ATTENTION_DIMS", range(16, 257, 16))
    g = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for keys, tokens, dim in ((33, 3, 16), (77, 1, 48), (150, 5, 80), (201, 8, 64), (31, 2, 128), (150, 1, 80)):
            q = torch.randn(1, 9, tokens, dim, generator=g).bfloat16()
            k, v = (torch.randn(1, 3, keys, dim, generator=g).bfloat16() for _ in range(2))
            mask = torch.zeros(1, 1, tokens, keys, dtype=torch.bfloat16)
            mask[..., ::7] = float("-inf")
            got = bf16_kernel.attention(q, k, v, mask, dim**-0.5)
            sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5,
                                                  enable_gqa=True).transpose(1, 2)
            exact = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(3, 1),
                                                   v.double().repeat_interleave(3, 1), attn_mask=mask.double(),
                                                   scale=dim**-0.5).transpose(1, 2)
            assert (got == sdpa).float().mean() > 0.8, (keys, tokens, dim)
            assert (got.double() - exact).abs().max() <= 1.01 * (sdpa.double() - exact).abs().max()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernels_causal_attention_is_bitwise_its_attention_under_the_causal_mask(isa, built, monkeypatch):
    """Causal attention without a mask (query t sees keys 0..K - T + t: a prompt's tokens over an empty cache, K = T,
    or over a cache holding K - T keys before them) is bitwise the attention under that mask: each pass over a few
    query rows reads only the keys its last row sees, and the keys it skips add nothing. Token counts within one pass
    and over several, passes that span two query heads, one row and several, and as close to float64 as SDPA's own
    causal attention."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    for batch, heads, kv_heads, tokens, keys, dim in ((1, 9, 3, 60, 60, 64), (1, 9, 3, 5, 5, 64), (2, 4, 2, 37, 37, 32),
                                                      (1, 8, 8, 19, 19, 128), (1, 9, 3, 7, 40, 64), (1, 2, 1, 1, 1, 64),
                                                      (1, 9, 3, 250, 250, 64)):
        query = torch.randn(batch, heads, tokens, dim).to(torch.bfloat16)
        key, value = (torch.randn(batch, kv_heads, keys, dim).to(torch.bfloat16) for _ in range(2))
        unseen = torch.ones(tokens, keys, dtype=torch.bool).triu(keys - tokens + 1)
        mask = torch.zeros(batch, 1, tokens, keys, dtype=torch.bfloat16).masked_fill(unseen, float("-inf"))
        causal = bf16_kernel.attention(query, key, value, None, dim**-0.5, causal=True)
        assert torch.equal(causal, bf16_kernel.attention(query, key, value, mask, dim**-0.5)), (tokens, keys)
        if keys == tokens:
            exact = _attention_in_float64(query, key, value, mask, dim**-0.5)
            sdpa = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True).transpose(1, 2)
            assert (causal.double() - exact).abs().max() <= 1.5 * (sdpa.double() - exact).abs().max() + 1e-3
    query, key = torch.randn(1, 4, 6, 64).to(torch.bfloat16), torch.randn(1, 2, 6, 64).to(torch.bfloat16)
    assert bf16_kernel.attention(query, key, key, torch.zeros(1, 1, 6, 6, dtype=torch.bfloat16), 0.125,
                                 causal=True) is None  # a mask of its own, or fewer keys than queries: not causal here
    assert bf16_kernel.attention(query, key[:, :, :5], key[:, :, :5], None, 0.125, causal=True) is None


def test_the_kernels_attention_leaves_what_it_does_not_take_to_sdpa(built, monkeypatch):
    """Float32 inputs, a head size it has no form for, a mask of another shape or a boolean one: None, so that SDPA
    attends."""
    if not RUNS:
        pytest.skip("no build runs on this CPU")
    q, k = torch.randn(1, 4, 2, 64).to(torch.bfloat16), torch.randn(1, 2, 10, 64).to(torch.bfloat16)
    for isa in RUNS:
        monkeypatch.setattr(KERNEL, "lib", built(isa))
        assert bf16_kernel.attention(q, k, k, None, 0.125) is not None
        assert bf16_kernel.attention(q.float(), k.float(), k.float(), None, 0.125) is None
        assert bf16_kernel.attention(q[..., :48], k[..., :48], k[..., :48], None, 0.125) is None
        assert bf16_kernel.attention(q, k, k, torch.zeros(1, 1, 2, 9, dtype=torch.bfloat16), 0.125) is None
        assert bf16_kernel.attention(q, k, k, torch.ones(1, 1, 2, 10, dtype=torch.bool), 0.125) is None


def _kernel_attends() -> bool:
    """Whether a build of the kernel is loaded here (both have attention)."""
    probe = torch.zeros(1, 1, 1, 32, dtype=torch.bfloat16)
    return bf16_kernel.cpu_supports() and bf16_kernel.available() and bf16_kernel.attention(probe, probe, probe, None,
                                                                                              1.0) is not None


def _record_attention(monkeypatch) -> list[int]:
    """The query tokens of each attention `bf16_kernel` computed (not those it left to SDPA)."""
    calls = []
    real = bf16_kernel.attention

    def attention(*args, **kwargs):
        out = real(*args, **kwargs)
        if out is not None:
            calls.append(args[0].shape[2])
        return out

    patch_kernel(monkeypatch, "attention", attention)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_layers_attend_in_the_kernel_only_where_asked_in_bf16(arch, monkeypatch):
    """With `pack` in bf16, the decoder layers' attention runs in the kernel where it has attention: a prefill of 6
    tokens without a mask (causal, as SDPA's forward takes it), a forward of 3 tokens under an explicit mask (as
    verify forwards pass one), and one token over the cache without a mask; the logits stay close to the model's
    own."""
    from clover_hf.base.lean_layers import lean_layers

    if not _kernel_attends():
        pytest.skip("no kernel on this CPU")
    calls = _record_attention(monkeypatch)
    ids = torch.randint(0, 256, (1, 10))
    for dtype, pack in ((torch.bfloat16, True), (torch.bfloat16, False), (torch.float32, True)):
        calls.clear()
        model = tiny_model(arch, dtype=dtype, head_dim=32)
        later = torch.ones(3, 9, dtype=torch.bool).triu(7)  # 3 new tokens over 6 cached: causal among themselves
        mask = torch.zeros(1, 1, 3, 9, dtype=dtype).masked_fill(later, torch.finfo(dtype).min)

        def run():
            with torch.no_grad():
                six = model(ids[:, :6], use_cache=True)
                three = model(ids[:, 6:9], attention_mask=mask, cache=six.past_key_values,
                              position_ids=torch.arange(6, 9)[None])
                return (six.logits.float(), three.logits.float(),
                        model(ids[:, 9:], cache=three.past_key_values).logits.float())

        want = run()
        with lean_layers(model, pack=pack):
            got = run()
        if dtype == torch.bfloat16 and pack:
            assert sorted(calls) == [1, 1, 3, 3, 6, 6]  # both layers: the prefill, the masked forward, one token
            assert all(torch.allclose(g, w, atol=0.05, rtol=0.05) for g, w in zip(got, want))
        else:
            assert not calls and all(torch.equal(g, w) for g, w in zip(got, want))


def _random_bf16_heads(norms: float = 0.0, **config):
    """A tiny bf16 Llama base and Clover heads (`config`: their options) of random weights, 0.3 x normal (the norms
    `norms` x normal where given, else ones), and the generator that drew them."""
    from clover_hf import CloverForCausalLM

    base = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    heads = CloverForCausalLM.from_base(base, **config).clover_heads.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in heads.named_parameters():
            if "norm" not in name or norms:
                p.copy_((norms if "norm" in name else 0.3) * torch.randn(p.shape, generator=g))
    return base, heads, g


def test_the_heads_draft_in_bf16_through_the_kernel_as_close_as_bf16_rounds(monkeypatch):
    """Without gradients in bf16 the heads' norms, rotary embedding and attention run in the kernel: the Augmenting
    Block's features, a few positions at a time over its cache, stay as close to float32's as torch's bf16 operations
    over the whole sequence at once (what training computes), give or take bf16 rounding. The Attention Decoder's gate
    runs in the kernel too."""
    if not _kernel_attends():
        pytest.skip("no kernel on this CPU")
    calls = _record_attention(monkeypatch)
    gates = []
    real_gate = bf16_kernel.cosine_gate
    patch_kernel(monkeypatch, "cosine_gate", lambda h, *args: gates.append(h.shape[1]) or real_gate(h, *args))
    base, heads, g = _random_bf16_heads()
    T, H = 23, base.config.hidden_size
    hidden, embeds = (torch.randn(1, T, H, generator=g).to(torch.bfloat16) for _ in range(2))
    positions = torch.arange(T)[None]
    with torch.enable_grad():
        want, _ = heads.features(hidden, embeds, positions)
    assert not calls
    parts, cache, start = [], None, 0
    with torch.no_grad():
        for size in (9, 1, 3, 1, 5, 4):
            out, cache = heads.features(hidden[:, start : start + size], embeds[:, start : start + size],
                                        positions[:, start : start + size], cache)
            parts.append(out)
            start += size
    assert calls == gates == [9, 1, 3, 1, 5, 4]
    got = torch.cat(parts, dim=1).float()
    exact, _ = copy.deepcopy(heads).float().features(hidden.float(), embeds.float(), positions)
    torch_error = (want.detach().float() - exact).abs().max()
    assert (got - exact).abs().max() <= 1.5 * torch_error + 2**-7 * exact.abs().max()


@pytest.mark.parametrize("isa", BUILDS)
def test_the_cosine_gate_is_as_close_to_float64_as_torchs_bf16_ops(isa, built, monkeypatch):
    """h + v * cos(q, k) per head: within torch's own bf16 error plus a bf16 step, at one and several rows, with a zero
    query (its norm taken as eps, as F.cosine_similarity takes it: a zero gate)."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    for rows in (1, 3):
        h, q, k, v = (torch.randn(2, rows, 96).to(torch.bfloat16) for _ in range(4))
        q[0, 0, :32] = 0
        split = (2, rows, 3, 32)
        cosine = F.cosine_similarity(q.view(split), k.view(split), dim=-1).unsqueeze(-1)
        by_torch = h + (v.view(split) * cosine).flatten(-2)
        exact = h.double() + (v.double().view(split) * F.cosine_similarity(
            q.double().view(split), k.double().view(split), dim=-1).unsqueeze(-1)).flatten(-2)
        got = bf16_kernel.cosine_gate(h, q, k, v, 3)
        assert got.dtype == torch.bfloat16 and got.shape == h.shape
        assert torch.equal(got[0, 0, :32], h[0, 0, :32])
        assert (got.double() - exact).abs().max() <= (by_torch.double() - exact).abs().max() + 2**-7 * exact.abs().max()


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernels_argmax_picks_the_indices_torch_picks(isa, built, monkeypatch):
    """Ties (the first largest), NaN (the first NaN), infinities, signed zeros, every row -inf, rows of every length
    around the kernel's 32-value steps, and rows at a stride (a verify forward's first nodes): torch's indices."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    for trial in range(600):
        rows, width = trial % 5 + 1, trial % 97 + 1 + 32 * (trial % 3)
        x = torch.randn(rows, width)
        kind = trial % 6
        if kind == 1:
            x = x.round()
        elif kind == 2:
            x[x > 1] = float("nan")
        elif kind == 3:
            x[:] = float("-inf")
        elif kind == 4:
            x[x > 0.5] = float("inf")
        elif kind == 5:
            x = torch.where(x > 0, 0.0, -0.0)
        assert torch.equal(bf16_kernel.argmax(x), x.argmax(-1)), (kind, x)
    logits = torch.randn(8, 49152)
    assert torch.equal(bf16_kernel.argmax(logits[:3]), logits[:3].argmax(-1))
    assert bf16_kernel.argmax(logits.bfloat16()) is None and bf16_kernel.argmax(logits.T) is None


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernels_top_probabilities_are_softmax_then_topk(isa, built, monkeypatch):
    """The k likeliest of each row and their softmax probabilities, as torch's softmax and topk give them (to float32
    summation); of equal logits the first ranks first; what it does not take is left to torch."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    for trial in range(300):
        rows, width = trial % 4 + 1, (1, 7, 8, 9, 100, 8192)[trial % 6]
        k = min((1, 3, 5, 10)[trial % 4], width)
        logits = (torch.randn(rows, width) * 3).bfloat16()
        probs, indices = bf16_kernel.top_probs(logits, k)
        full = logits.float().softmax(-1)
        torch.testing.assert_close(probs, full.gather(1, indices), rtol=1e-5, atol=1e-7)
        assert torch.equal(full.topk(k, dim=-1).values, full.gather(1, indices))  # the k largest, largest first
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]).bfloat16()
    assert bf16_kernel.top_probs(ties, 3)[1].tolist() == [[1, 2, 4]]
    assert bf16_kernel.top_probs(ties.float(), 3) is None and bf16_kernel.top_probs(ties, 6) is None


@pytest.mark.parametrize("isa", BUILDS)
def test_the_fused_silu_times_up_is_bitwise_torchs_on_random_inputs(isa, built, monkeypatch):
    """F.silu(gate) * up in bf16, read from the parts of a stacked gate/up product (rows at a stride) or contiguous:
    bitwise torch's on random inputs at several scales, and where e^-x leaves float32's range (infinities, NaN,
    -88.5); inputs not of that form are left to torch."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    for trial in range(40):
        width = (1536, 64, 13)[trial % 3]
        stacked = (torch.randn(2, trial % 5 + 1, 2 * width) * (1 + trial % 7)).bfloat16()
        gate, up = stacked.split([width, width], dim=-1)
        assert torch.equal(bf16_kernel.silu_mul(gate, up), F.silu(gate) * up)
        assert torch.equal(bf16_kernel.silu_mul(gate.contiguous(), up), F.silu(gate) * up)
    edges = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -100.0, 100.0, 88.5, -88.5, 1e-40,
                          -87.9, -89.0] * 2).bfloat16()[None]
    ones = torch.ones_like(edges)
    torch.testing.assert_close(bf16_kernel.silu_mul(edges, ones), F.silu(edges) * ones, rtol=0, atol=0, equal_nan=True)
    square = torch.randn(4, 4).bfloat16()
    assert bf16_kernel.silu_mul(square.T, square) is None and bf16_kernel.silu_mul(square.float(), square.float()) is None


@pytest.mark.parametrize("isa", BUILDS)
def test_the_residual_sum_and_its_norm_in_one_call_are_torchs_add_and_the_fused_norm(isa, built, monkeypatch):
    """A decoder layer's residual sum, bitwise torch's bf16 add, and the RMSNorm of it, bitwise the fused norm's; inputs
    not of that form are left to torch."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    weight = torch.randn(576).bfloat16()
    add_norm, norm = bf16_kernel.add_rms_norm(weight, 1e-5), bf16_kernel.rms_norm(weight, 1e-5, None)
    for rows in (1, 3, 16):
        a, b = torch.randn(2, rows, 576).bfloat16(), (torch.randn(2, rows, 576) * 4).bfloat16()
        total, normed = add_norm(a, b)
        assert torch.equal(total, a + b) and torch.equal(normed, norm(a + b))
    assert add_norm(a.float(), b.float()) is None and add_norm(a[..., :64], b[..., :64]) is None


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("arch,batch", [("llama", 1), ("qwen2", 1), ("llama", 2)])
def test_a_whole_decoder_layer_in_one_call_is_bitwise_its_calls_one_by_one(arch, batch, isa, built, monkeypatch):
    """With every product in the tiled form (q/k/v, with qwen2's biases, and gate/up stacked) over a growing cache, a
    bf16 model's decoder layers run as one kernel call all together (or, the stack off, one a layer) for a masked
    forward of 3 tokens a row and a one-token one without a mask: logits and cached keys and values bitwise those of
    their kernel calls one by one. A causal prefill without a mask, and products without tiled copies, leave it to those
    calls."""
    import clover_hf.base.lean_layers as lean
    from clover_hf.base.cache import new_cache

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    calls = []
    for kind in (lean._WholeLayer, lean._Stack):
        def recorded(self, x, *args, _real=kind.__call__, _kind=kind.__name__):
            out = _real(self, x, *args)
            if out is not None:
                calls.append((_kind, x.shape[1]))
            return out

        monkeypatch.setattr(kind, "__call__", recorded)
    model = tiny_model(arch, dtype=torch.bfloat16, head_dim=32)
    ids = torch.randint(0, 256, (batch, 10))
    later = torch.ones(3, 9, dtype=torch.bool).triu(7)  # 3 new tokens over 6 cached: causal among themselves
    mask = torch.zeros(batch, 1, 3, 9, dtype=torch.bfloat16).masked_fill(later, torch.finfo(torch.bfloat16).min)
    mask[1:, :, 1:, 7] = torch.finfo(torch.bfloat16).min  # other rows: a tree, not a chain

    def run(forms):
        calls.clear()
        copies = WeightCopies(limit=10**9)
        with torch.no_grad(), lean.lean_layers(model, pack=True), linear_forms([model], forms, copies):
            cache = new_cache()
            first = model(ids[:, :6], cache=cache, use_cache=True).logits
            three = model(ids[:, 6:9], attention_mask=mask, cache=cache,
                          position_ids=torch.arange(6, 9).expand(batch, 3)).logits
            one = model(ids[:, 9:], cache=cache, position_ids=torch.tensor([[9]]).expand(batch, 1)).logits
        return [first, three, one, *(t for layer in cache.layers for t in (layer.keys, layer.values))]

    tiled = {1 << k: TILED for k in range(5)}
    got = run(tiled)
    assert calls == [("_Stack", 3), ("_Stack", 1)]  # both layers in one call, the masked forward and the one-token one
    # a row count of a verify forward's that settled on another form still runs in the kernel's tiled copies
    assert all(torch.equal(g, w) for g, w in zip(run({**tiled, batch: "linear"}), got))
    assert calls == [("_Stack", 3), ("_Stack", 1)]
    run({1 << k: "linear" for k in range(5)})  # no tiled copies
    assert not calls
    monkeypatch.setattr(lean._Stack, "ready", lambda self, layers: None)  # one call a layer
    assert all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(run(tiled), got))
    assert calls == [("_WholeLayer", 3)] * 2 + [("_WholeLayer", 1)] * 2
    monkeypatch.setattr(lean, "_whole_layer", lambda layer: None)  # the kernel's calls one by one
    want = run(tiled)
    assert got[3].shape == (batch, 2, 10, 32) and not calls
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("isa", BUILDS)
def test_the_augmenting_blocks_layers_in_one_call_each_are_bitwise_their_calls_one_by_one(isa, built, monkeypatch):
    """Drafting in bf16 with the heads' products in the tiled form, each Augmenting Block layer extends its cache as
    one kernel call once the cache holds keys (not for the first positions): the features and the cached keys and
    values bitwise those of its calls one by one, a few positions at a time; the heads can still be copied."""
    from clover_hf.heads.augment import AugmentLayer

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    base, heads, g = _random_bf16_heads()
    T, H = 23, base.config.hidden_size
    hidden, embeds = (torch.randn(1, T, H, generator=g).to(torch.bfloat16) for _ in range(2))
    positions = torch.arange(T)[None]
    whole_calls = []
    real = AugmentLayer._whole_layer

    def recorded(self, x, *args):
        out = real(self, x, *args)
        if out is not None:
            whole_calls.append(x.shape[1])
        return out

    def run():
        parts, cache, start = [], None, 0
        with torch.no_grad(), linear_forms([heads], {1 << k: TILED for k in range(5)}, WeightCopies(limit=10**9)):
            for size in (9, 1, 3, 1, 5, 4):
                out, cache = heads.features(hidden[:, start: start + size], embeds[:, start: start + size],
                                            positions[:, start: start + size], cache)
                parts.append(out)
                start += size
        return [torch.cat(parts, dim=1), *(t for layer in cache.layers for t in (layer.keys, layer.values))]

    monkeypatch.setattr(AugmentLayer, "_whole_layer", recorded)
    got = run()
    assert whole_calls == [size for size in (1, 3, 1, 5, 4) for _ in heads.augment]
    copy.deepcopy(heads)  # the kernel's layer is kept outside the module: copying it still works
    monkeypatch.setattr(AugmentLayer, "_whole_layer", lambda self, *args: None)
    want = run()
    assert got[1].shape[2] == T
    assert all(g.shape == w.shape and torch.equal(g, w) for g, w in zip(got, want))


@needs_kernel
def test_where_torch_has_no_bf16_products_a_first_call_takes_the_tiled_forms_without_trials(tmp_path, monkeypatch):
    """bf16 on a CPU whose torch converts bf16 around each product, with the kernel built: the forms are the kernel's
    tiled copies at every row count from the first call (stored, nothing pending), no form trials run, and the copies
    are made; where oneDNN computes bf16, or in float32, the forms are learnt as before."""
    import clover_hf.cpu.linears as linears
    from clover_hf import CloverForCausalLM, DraftBudget
    from clover_hf.backends import FormBook

    from .tiny import prompt

    monkeypatch.setattr(linears, "onednn_serves", lambda dtype: False)
    clover = CloverForCausalLM.from_base(tiny_model("llama", dtype=torch.bfloat16))
    budget = DraftBudget(cache_dir=tmp_path)
    clover.generate(prompt(4), max_new_tokens=8, do_sample=False, budget=budget)
    book = FormBook.of(budget)
    (key, stored), = book._machines.items()
    assert stored.forms == {1 << k: TILED for k in range(9)} and not stored.pending and not book._trials
    assert book.copies.nbytes > 0 and FormBook(cache_dir=tmp_path).stored(key).forms == stored.forms
    assert linears.evident_forms([clover.base_model], 0) is None  # the copies must fit
    monkeypatch.setattr(linears, "onednn_serves", lambda dtype: True)
    assert linears.evident_forms([clover.base_model], 10**9) is None
    monkeypatch.setattr(linears, "onednn_serves", lambda dtype: False)
    assert linears.evident_forms([tiny_model("llama")], 10**9) is None  # float32


@pytest.mark.parametrize("isa", BUILDS)
def test_the_kernels_take_the_tiled_copies_at_a_verify_forwards_row_counts_whatever_form_those_settled_on(isa, built,
                                                                                                        monkeypatch):
    """A row count up to PACK_ROWS that settled on another form (F.linear timed a little faster product by product, or
    by chance) still has its kernel calls: the decoder layers' tiled weights. Past PACK_ROWS (a prefill) the row
    count's own form stands."""
    from clover_hf.cpu.binding import kernel_weights, layer_weights
    from clover_hf.cpu.linears import LINEAR, PACK_ROWS
    from clover_hf.decode.drafting import static_trees

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    base, heads, g = _random_bf16_heads(norms=1.0, draft_vocab_size=64)
    heads.draft_token_ids.copy_(torch.randperm(base.config.vocab_size, generator=g)[:64])
    tree = static_trees(heads.config.tree, "cpu", 0, None)[0]
    gap = 1 << (tree.levels[1].parent_of_expanded.shape[0].bit_length() - 1)  # a row count its second level takes
    assert 1 < gap < 32
    tiled = {1 << k: TILED for k in range(9)}
    gaps = {rows: form for rows, form in tiled.items() if rows not in (gap, 32)}  # those and 32-63 rows: F.linear
    for forms in (tiled, gaps):
        with torch.no_grad(), linear_forms([base, heads], forms, WeightCopies(limit=10**9)):
            layer = base.model.layers[0]
            projections = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
            assert all(layer_weights(rows, *projections) is not None for rows in range(1, PACK_ROWS + 1))
            assert (layer_weights(40, *projections) is None) is (forms is gaps)
            assert (kernel_weights(heads.heads[0].fc, 40, [heads.heads[0].fc.out_features]) is None) is (forms is gaps)
            assert layer.mlp.down_proj.forward.form_of(gap) == (LINEAR if forms is gaps else TILED)


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("arch,batch,pre_norm", [("llama", 1, False), ("qwen2", 2, True), ("mistral", 1, True)])
def test_verify_forwards_of_a_model_whose_layers_run_in_one_call_skip_its_python_bitwise(arch, batch, pre_norm, isa,
                                                                                         built, monkeypatch):
    """bf16, every product in the tiled form, all layers in one kernel call: a verify forward runs the decoder's
    embedding, mask and rotary embedding, that call, the final norm and the lm_head by themselves (the model's lean
    forward), checked against the model's own forward at the first call (which then returns the own forward's output):
    logits, hidden states (after or before the final norm) and cache bitwise those of the model's own forwards, for a
    tree of 3 tokens a row and a one-token step (its rows padded but the first: the mask it skips where none are). Where
    the check fails its own forward runs from then on, with a
    warning; so it does where the model has hooks."""
    import clover_hf.base.lean_layers as lean
    from clover_hf.base import verify_forward
    from clover_hf.base.cache import new_cache

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    monkeypatch.setattr(lean.VERDICTS, "models", {})
    ran = []
    real = lean._ModelForward.__call__
    monkeypatch.setattr(lean._ModelForward, "__call__", lambda self, *a: (lambda out: ran.append(out is not None) or out)(
        real(self, *a)))
    model = tiny_model(arch, dtype=torch.bfloat16, head_dim=32, **({"sliding_window": None} if arch == "mistral" else {}))
    ids = torch.randint(0, 256, (batch, 10))
    later = torch.ones(3, 9, dtype=torch.bool).triu(7)
    mask = torch.zeros(batch, 1, 3, 9, dtype=torch.bfloat16).masked_fill(later, torch.finfo(torch.bfloat16).min)
    mask[1:, :, 1:, 7] = torch.finfo(torch.bfloat16).min  # other rows: a tree, not a chain

    settled = []  # whether each verify forward's time is its step's: not the one that ran the check

    def run():
        with torch.no_grad(), lean.lean_layers(model, pack=True), linear_forms(
                [model], {1 << k: TILED for k in range(5)}, WeightCopies(limit=10**9)):
            cache = new_cache()
            model(ids[:, :6], cache=cache, use_cache=True)
            verify = verify_forward.VerifyForward(model, pre_norm)
            three = verify(ids[:, 6:9], mask, torch.arange(6, 9).expand(batch, 3), cache)
            settled.append(verify.settled)
            one_mask = torch.ones(batch, 10, dtype=torch.long)
            one_mask[1:, :2] = 0  # other rows: padding, which one token must not see
            one = verify(ids[:, 9:], one_mask, torch.tensor([[9]]).expand(batch, 1), cache)
            settled.append(verify.settled)
            assert three.targets is None and one.targets is None  # logits asked for
        return [*three[:2], *one[:2], *(t for layer in cache.layers for t in (layer.keys, layer.values))]

    got = run()
    # a padded row's one-token mask (bool, as transformers makes it) is not one the kernel takes: the own forward runs
    assert ran == [True, batch == 1] and list(lean.VERDICTS.models.values()) == [True]
    assert settled == [False, True]
    real_forward = verify_forward.model_forward
    monkeypatch.setattr(verify_forward, "model_forward", lambda model: None)
    want = run()
    assert got[1].shape == (batch, 3, model.config.hidden_size) and got[7].shape[2] == 10
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)

    monkeypatch.setattr(verify_forward, "model_forward", real_forward)
    hook = model.model.norm.register_forward_hook(lambda *args: None)
    ran.clear()
    assert all(torch.equal(g, w) for g, w in zip(run(), want)) and ran == [False, False]
    hook.remove()
    monkeypatch.setattr(lean.VERDICTS, "models", {})
    real_norm = lean._norm  # a lean forward that differs: no final norm
    monkeypatch.setattr(lean, "_norm", lambda module, fused: (lambda x: x) if module is model.model.norm else real_norm(
        module, fused))
    ran.clear()
    with pytest.warns(UserWarning, match="does not match"):
        again = run()
    assert ran == [True, False] and list(lean.VERDICTS.models.values()) == [False]  # the own forward's output returned
    assert all(torch.equal(g, w) for g, w in zip(again, want))


@pytest.mark.parametrize("isa", BUILDS)
def test_verify_forwards_of_changing_widths_look_each_forms_weights_up_once(isa, built, monkeypatch):
    """Drafted steps change width every few steps: the layers in one kernel call look the weights of each form up once
    a block of linear forms (not at every change, nor for each row count of the form), a tree's mask goes through the
    model's mask function until it is seen returned as given, and forwards of 3, 1, 3 and 1 tokens stay bitwise the
    model's own."""
    import clover_hf.base.lean_layers as lean
    from clover_hf.base import verify_forward
    from clover_hf.base.cache import new_cache

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    monkeypatch.setattr(lean.VERDICTS, "models", {})
    looked, masked = [], []
    real_weights = lean._WholeLayer.weights
    monkeypatch.setattr(lean._WholeLayer, "weights", lambda self, rows: looked.append(rows) or real_weights(self, rows))
    from transformers.models.llama import modeling_llama as llama

    real_mask = llama.create_causal_mask
    monkeypatch.setattr(llama, "create_causal_mask", lambda **kwargs: masked.append(1) or real_mask(**kwargs))
    model = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    ids = torch.randint(0, 256, (1, 14))

    def run():
        outs = []
        with torch.no_grad(), lean.lean_layers(model, pack=True), linear_forms(
                [model], {1 << k: TILED for k in range(5)}, WeightCopies(limit=10**9)):
            cache = new_cache()
            model(ids[:, :6], cache=cache, use_cache=True)
            verify, at = verify_forward.VerifyForward(model, False), 6
            for width in (3, 1, 3, 1):
                if width == 1:
                    mask = torch.ones(1, at + 1, dtype=torch.long)
                else:
                    later = torch.ones(width, at + width, dtype=torch.bool).triu(at + 1)
                    mask = torch.zeros(1, 1, width, at + width, dtype=torch.bfloat16).masked_fill(
                        later, torch.finfo(torch.bfloat16).min)
                outs += verify(ids[:, at : at + width], mask, torch.arange(at, at + width)[None], cache)[:2]
                at += width
        return outs + [t for layer in cache.layers for t in (layer.keys, layer.values)]

    got = run()
    layers = model.config.num_hidden_layers
    assert looked == [3] * layers  # 1 row's form is 3 rows': their weights are one lookup
    # the prefill's mask, the first 3-token forward's tree mask (which the model's mask function returned as given) and
    # the model's own forward that checks it: the second 3-token forward's is not asked
    assert len(masked) == 3
    monkeypatch.setattr(verify_forward, "model_forward", lambda model: None)
    want = run()
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("isa", BUILDS)
def test_verify_forwards_that_outgrow_the_caches_stores_point_the_kernels_at_the_new_ones(isa, built, monkeypatch):
    """The layers in one kernel call keep pointing at the cache's stores while those hold the slots and have room;
    forwards that outgrow them (stores of 2 spare slots), or follow keys and values a caller set, get new stores, which
    the kernels are pointed at: the outputs and the cache stay bitwise those of the layers run one by one, and the
    stores were made anew along the way."""
    import clover_hf.base.lean_layers as lean
    from clover_hf.base import verify_forward
    from clover_hf.base.cache import GrowingLayer, new_cache

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    monkeypatch.setattr(lean.VERDICTS, "models", {})
    monkeypatch.setattr(GrowingLayer, "SPARE", 2)
    model = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    ids = torch.randint(0, 256, (1, 40))

    def run():
        outs, made = [], set()
        with torch.no_grad(), lean.lean_layers(model, pack=True), linear_forms(
                [model], {1 << k: TILED for k in range(5)}, WeightCopies(limit=10**9)):
            cache = new_cache()
            model(ids[:, :6], cache=cache, use_cache=True)
            verify, at = verify_forward.VerifyForward(model, False), 6
            for width in (1, 3, 1, 4, 4, 2, 1, 5, 1, 6, 3):
                later = torch.ones(width, at + width, dtype=torch.bool).triu(at + 1)
                mask = torch.zeros(1, 1, width, at + width, dtype=torch.bfloat16).masked_fill(
                    later, torch.finfo(torch.bfloat16).min)
                outs += verify(ids[:, at : at + width], mask, torch.arange(at, at + width)[None], cache)[:2]
                made.add(cache.layers[0].stores[0].data_ptr())
                at += width
                if width == 2:  # a caller sets keys and values of its own: the stores hold them no longer
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys.clone(), layer.values * 2
        return outs + [t for layer in cache.layers for t in (layer.keys, layer.values)], made

    got, made = run()
    assert len(made) > 2  # the stores were outgrown and made anew more than once
    monkeypatch.setattr(lean._Stack, "__call__", lambda self, *args: None)  # each layer by itself, its stores asked
    want, _ = run()
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("isa", BUILDS)
def test_the_layers_in_one_call_point_at_their_cache_again_after_a_layer_by_itself_wrote_another(isa, built,
                                                                                                   monkeypatch):
    """Between two forwards over one cache in one kernel call, the layers ran one by one over another cache (their
    kernels pointed at its stores): the next forward points them back, its output and cache bitwise those of the
    layers run one by one throughout."""
    import clover_hf.base.lean_layers as lean
    from clover_hf.base import verify_forward
    from clover_hf.base.cache import new_cache

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    monkeypatch.setattr(lean.VERDICTS, "models", {})
    model = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    ids, other_ids = torch.randint(0, 256, (1, 9)), torch.randint(0, 256, (1, 9))
    stack = lean._Stack.__call__

    def one_by_one(self, *args):  # the stack refuses: each layer computes by itself
        return None

    def run(stack):
        with torch.no_grad(), lean.lean_layers(model, pack=True), linear_forms(
                [model], {1 << k: TILED for k in range(5)}, WeightCopies(limit=10**9)):
            caches = new_cache(), new_cache()
            for cache, prompt in zip(caches, (ids, other_ids)):
                model(prompt[:, :6], cache=cache, use_cache=True)
            verify, outs = verify_forward.VerifyForward(model, False), []
            for at, cache, prompt in ((6, caches[0], ids), (6, caches[1], other_ids), (7, caches[0], ids)):
                monkeypatch.setattr(lean._Stack, "__call__", stack if cache is caches[0] else one_by_one)
                mask = torch.ones(1, at + 1, dtype=torch.long)
                outs += verify(prompt[:, at : at + 1], mask, torch.arange(at, at + 1)[None], cache)[:2]
        return outs + [t for cache in caches for layer in cache.layers for t in (layer.keys, layer.values)]

    got = run(stack)
    want = run(one_by_one)
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


@pytest.mark.parametrize("isa", BUILDS)
def test_the_keys_laid_out_beside_the_cache_are_laid_out_again_where_they_changed(isa, built, monkeypatch):
    """The AVX-512 build keeps each layer's keys laid out for its attention beside the cache (`KeyLayout`) and lays out
    only the slots written since: verify forwards whose trees are compacted (kept nodes moved back), a forward of the
    layers in torch's ops (their keys written by the cache's update), a cache cut back and written again, and stores
    outgrown (2 spare slots): outputs and cache bitwise those with the keys laid out afresh at every call."""
    import clover_hf.base.lean_layers as lean
    from clover_hf.base import verify_forward
    from clover_hf.base.cache import GrowingLayer, compact_cache, new_cache

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    monkeypatch.setattr(lean.VERDICTS, "models", {})
    monkeypatch.setattr(GrowingLayer, "SPARE", 2)
    model = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    ids = torch.randint(0, 256, (1, 200))
    stack, whole = lean._Stack.__call__, lean._WholeLayer.__call__

    def run():
        outs, crossed, grown, last = [], False, 0, None
        with torch.no_grad(), lean.lean_layers(model, pack=True), linear_forms(
                [model], {1 << k: TILED for k in range(5)}, WeightCopies(limit=10**9)):
            cache = new_cache()
            model(ids[:, :20], cache=cache, use_cache=True)
            verify, at = verify_forward.VerifyForward(model, False), 20
            for step, width in enumerate((4, 1, 19, 3, 5, 2, 7, 1, 15, 4, 9, 2, 5, 9, 3, 7, 9)):
                if step in (4, 8):  # the layers in torch's ops: the cache's update writes the keys
                    monkeypatch.setattr(lean._Stack, "__call__", lambda self, *args: None)
                    monkeypatch.setattr(lean._WholeLayer, "__call__", lambda self, *args: None)
                later = torch.ones(width, at + width, dtype=torch.bool).triu(at + 1)
                mask = torch.zeros(1, 1, width, at + width, dtype=torch.bfloat16).masked_fill(
                    later, torch.finfo(torch.bfloat16).min)
                outs += verify(ids[:, at : at + width], mask, torch.arange(at, at + width)[None], cache)[:2]
                store = cache.layers[0].stores[0]
                grown, last = grown + (last is not None and store is not last), store
                if step not in (4, 8) and cache.layers[0]._key_layout is not None and isa == "avx512_bf16":
                    # laid out up to this forward's new keys, whose slots compaction may change
                    assert all(layer._key_layout.laid.value == at for layer in cache.layers), step
                monkeypatch.setattr(lean._Stack, "__call__", stack)
                monkeypatch.setattr(lean._WholeLayer, "__call__", whole)
                keep = torch.tensor([list(range(0, width, 2))])  # every other node: those after the root move back
                compact_cache(cache, at, keep)
                # keys the kernel laid out, moved, in a block of 16 before the one the next forward (in the kernel too)
                # writes in
                crossed |= (keep.shape[1] > 1 and (at + 1) // 16 < (at + keep.shape[1]) // 16
                            and step not in (3, 4, 7, 8, 12))
                at += keep.shape[1]
                if step in (7, 12):  # the cache cut back below the slots laid out (past a block of 16), then written
                    # again by the next forward: in torch's ops, and past them (step 8), in the kernel (step 13)
                    at -= 20
                    for layer in cache.layers:
                        layer.keys, layer.values = layer.keys[:, :, :at], layer.values[:, :, :at]
                for layer in cache.layers:  # the blocks the next forward takes as laid out are the keys' own
                    _check_laid_out(layer._key_layout, layer.stores[0], min(at, layer._key_layout.laid.value)
                                    if layer._key_layout is not None else 0)
        laid = [layer._key_layout.laid.value if layer._key_layout is not None else 0 for layer in cache.layers]
        return outs + [t for layer in cache.layers for t in (layer.keys, layer.values)], laid, crossed, grown

    got, laid, crossed, grown = run()
    assert crossed and grown  # kept keys moved across a block of 16; the stores outgrown (their layout made anew)
    if isa == "avx512_bf16":
        assert all(n > 20 for n in laid)  # the layouts were kept and extended
    monkeypatch.setattr(GrowingLayer, "key_layout", lambda self: None)  # laid out afresh at every call
    want, _, _, _ = run()
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)


def _check_laid_out(layout, keys: torch.Tensor, slots: int) -> None:
    """The `layout` of `keys` (B, heads, slots, D) bf16 holds their first `slots` // 16 blocks of 16 keys as the AVX-512
    build lays them out: per block, each pair of a key's values (a uint32) at [pair][key]."""
    if layout is None or layout.words is None or layout.keys is not keys:
        return
    batch, heads, _, dim = keys.shape
    blocks = slots // 16
    pairs = keys[:, :, : blocks * 16].contiguous().view(torch.int32).view(batch, heads, blocks, 16, dim // 2)
    want = pairs.transpose(3, 4).reshape(batch, heads, -1)
    got = layout.words.view(batch, heads, layout.head)[:, :, : blocks * 16 * (dim // 2)]
    assert torch.equal(got, want), slots


def _weight_to_screen(out_features: int, in_features: int) -> torch.Tensor:
    """A random bf16 weight whose rows 32-63 lie near row 17, apart by about the int8 copy's rounding (their logits are
    ordered by what it rounds), rows 5, 17 and 40 tie exactly, and then one weight of row 40 is a last bit larger."""
    weight = (torch.randn(out_features, in_features) * 0.2).bfloat16()
    weight[32:64] = (weight[17].float() + 0.002 * torch.randn(32, in_features)).bfloat16()
    weight[5] = weight[17] = weight[40]
    weight[40, 3] = (weight[40, 3:4].view(torch.int16) + 1).view(torch.bfloat16)[0]
    return weight


def _screen_cases(rows: int, shapes):
    """(screen, the tiled product, x) for weights of these shapes (`_weight_to_screen`), with and without a bias, and
    bf16 rows x over six orders of magnitude, every other one leaning to rows 5, 17 and 40."""
    for out_features, in_features in shapes:
        weight = _weight_to_screen(out_features, in_features)
        for bias in (None, torch.randn(out_features) * 0.1):
            screen = bf16_kernel.Screen.of(weight, bias)
            whole = bf16_kernel.product(bf16_kernel.tile(weight), bias)
            for scale in (1e-3, 1.0, 1e3):
                x = torch.randn(rows, in_features) * scale
                x[::2] += 4 * scale * weight[17].float()
                yield screen, whole, x.bfloat16()


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 9, 14])
def test_the_lm_heads_screen_chooses_the_argmax_of_the_tiled_products_logits(isa, rows, built, monkeypatch):
    """`Screen` gives each row's first largest logit of the tiled product (with and without a bias) without computing
    them all: random rows over six orders of magnitude, and rows leaning to weight rows that tie exactly (the first
    wins), differ by one last bit of one weight (logits a bf16 rounding apart) or by about what the int8 copy rounds
    (a bound short of that rounding chose wrongly). Of SmolLM2's width and 1,024 rows, it computes a few columns a
    row exactly."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(rows)
    for screen, whole, x in _screen_cases(rows, ((64, 32), (256, 96), (1024, 576))):
        assert torch.equal(screen(x), whole(x).float().argmax(-1))
        assert screen.counts.shape == (rows,) and (screen.counts >= 1).all()
        out_features, in_features = screen.weight.shape
        if out_features == 1024:
            assert screen.counts.float().mean() < 40
        assert screen.nbytes() == out_features * in_features + 3 * 4 * out_features


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_the_lm_heads_screen_takes_every_column_of_the_top_k(isa, rows, built, monkeypatch):
    """`Screen.top_k` takes, ascending, every column whose logit is at least its row's k-th largest (equal ones
    included), and gives those columns' logits as the tiled product rounds them: over the argmax test's weights (exact
    ties, last-bit differences, rows the int8 copy barely tells apart) and scales, with and without a bias. A bound
    short of the weights' rounding misses columns of this test. Where more columns would be taken than `room`, none."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(rows)
    for screen, whole, x in _screen_cases(rows, ((64, 32), (1024, 576))):
        logits = whole(x).float()
        for k in (1, 5, 50):
            columns, values = screen.top_k(x, k)
            kth = logits.topk(k).values[:, -1:]
            assert bool((columns[1:] > columns[:-1]).all()) and columns.numel() >= k
            kept = (logits >= kth).any(0).nonzero()[:, 0]
            assert bool(torch.isin(kept, columns).all()), k
            assert torch.equal(values, logits[:, columns])
        assert screen.top_k(x, 50, room=49) is None


@pytest.mark.parametrize("isa", BUILDS)
def test_the_screen_declines_what_it_cannot_bound(isa, built, monkeypatch):
    """No screen of a weight with a value not finite or of a shape the tiled product does not take; rows not finite
    are not chosen for (None), nor are rows of another size or dtype."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    weight = torch.randn(64, 32).bfloat16()
    assert bf16_kernel.Screen.of(weight[:48], None) is None
    assert bf16_kernel.Screen.of(weight.float(), None) is None
    broken = weight.clone()
    broken[7, 2] = float("nan")
    assert bf16_kernel.Screen.of(broken, None) is None
    screen = bf16_kernel.Screen.of(weight, None)
    x = torch.randn(3, 32).bfloat16()
    assert torch.equal(screen(x), bf16_kernel.linear(x, bf16_kernel.tile(weight), None).float().argmax(-1))
    x[1, 4] = float("inf")
    assert screen(x) is None
    assert screen(torch.randn(3, 30).bfloat16()) is None and screen(torch.randn(3, 32)) is None


@pytest.mark.parametrize("isa", BUILDS)
def test_an_lm_heads_screen_is_kept_while_its_weight_and_bias_are_unchanged(isa, built, monkeypatch):
    """The screen of an nn.Linear lm_head is made once and served again, and made anew where its weight changed in
    place or was replaced, or its bias changed: a stale screen would bound the old weights' logits."""
    from clover_hf.base.lean_model import lm_head_screen

    monkeypatch.setattr(KERNEL, "lib", built(isa))
    lm_head = torch.nn.Linear(32, 64, bias=True).bfloat16()
    x = torch.randn(3, 32).bfloat16()
    assert lm_head_screen(lm_head) is None  # a weight being trained
    lm_head.requires_grad_(False)
    first = lm_head_screen(lm_head)
    assert first is not None and lm_head_screen(lm_head) is first

    def served():
        screen = lm_head_screen(lm_head)
        want = bf16_kernel.linear(x, bf16_kernel.tile(lm_head.weight), lm_head.bias.float()).float().argmax(-1)
        assert torch.equal(screen(x), want)
        return screen

    with torch.no_grad():
        lm_head.weight[5].fill_(3.0)  # in place: a new version
        second = served()
        assert second is not first and lm_head_screen(lm_head) is second
        lm_head.weight = torch.nn.Parameter(torch.randn(64, 32).bfloat16(), requires_grad=False)  # replaced
        third = served()
        assert third is not second
        lm_head.bias[9] += 100.0
        assert served() is not third


def _verify_settled(monkeypatch) -> list[bool]:
    """Each verify forward's `settled` from now on, a process's one-off checks (the lean forward's and the lm_head
    screen's) to run again."""
    import clover_hf.base.lean_layers as lean
    from clover_hf.base import verify_forward

    settled = []
    real = verify_forward.VerifyForward.__call__
    monkeypatch.setattr(verify_forward.VerifyForward, "__call__",
                        lambda self, *a: (lambda out: settled.append(self.settled) or out)(real(self, *a)))
    monkeypatch.setattr(lean.VERDICTS, "models", {})
    monkeypatch.setattr(lean.VERDICTS, "screens", {})
    return settled


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_decoding_reads_the_lm_heads_screen_and_emits_the_same_tokens(arch, monkeypatch):
    """bf16, every product tiled, whole trees verified: where a call reads no logits but each node's argmax, the lean
    verify forward gives the screen's choices instead of logits, and the tokens are those of the whole logits' argmax.
    A call that keeps scores, or whose stopping criteria may read them, computes the logits whole; so does every call
    after a screen's first choices in a process differed from the logits' argmax. The forward that makes the screen
    and checks its first choices is no step's cost."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    import clover_hf.base.lean_layers as lean
    from clover_hf import CostModel, DraftBudget

    from .tiny import prompt, random_heads

    screened = []
    real = bf16_kernel.Screen.__call__
    monkeypatch.setattr(bf16_kernel.Screen, "__call__", lambda self, x: screened.append(x.shape[0]) or real(self, x))
    base = tiny_model(arch, dtype=torch.bfloat16, head_dim=32, **({"sliding_window": None} if arch == "mistral" else {}))
    clover, _ = random_heads(base, lookup_tokens=3)
    clover = clover.to(torch.bfloat16)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)  # the whole tree every step
    forms = {1 << k: TILED for k in range(9)}

    def run(**kwargs):
        return clover.generate(prompt(4), max_new_tokens=24, do_sample=False, budget=DraftBudget(costs=costs, forms=forms),
                               **kwargs)

    settled = _verify_settled(monkeypatch)
    got = run()
    assert len(screened) > 5 and max(screened) > 2 and clover.generation_stats.verified_per_step > 2
    # the forwards that checked the lean forward, then made the screen and checked its first choices (a process's
    # first of each) are no step's cost
    assert settled[:2] == [False, False] and all(settled[2:])
    settled = _verify_settled(monkeypatch)
    with monkeypatch.context() as m:  # no screen at these row counts (an lm_head in another form): nothing checked
        m.setattr(lean._ModelForward, "_screen", lambda self, rows: None)
        assert torch.equal(run(), got)
    assert settled[:1] == [False] and all(settled[1:])  # the lean forward's check alone
    screened.clear()
    monkeypatch.setattr(lean._ModelForward, "_greedy", lambda self, normed: None)
    assert torch.equal(got, run()) and not screened
    monkeypatch.undo()
    monkeypatch.setattr(bf16_kernel.Screen, "__call__", lambda self, x: screened.append(x.shape[0]) or real(self, x))

    class Never(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    kept = run(output_scores=True, return_dict_in_generate=True)
    assert torch.equal(kept.sequences, got) and len(kept.scores) == 24 and not screened
    assert torch.equal(run(stopping_criteria=StoppingCriteriaList([Never()])), got) and not screened

    # a screen whose first choices in a process differ from the logits' argmax is not used again, with a warning
    monkeypatch.setattr(lean.VERDICTS, "screens", {})
    monkeypatch.setattr(bf16_kernel.Screen, "__call__", lambda self, x: screened.append(x.shape[0]) or (
        real(self, x) + 1) % 256)
    with pytest.warns(UserWarning, match="differed"):
        assert torch.equal(run(), got)
    assert len(screened) == 1 and list(lean.VERDICTS.screens.values()) == [False]


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampling_through_a_top_k_cut_reads_the_lm_heads_screen_and_draws_the_same_tokens(arch, monkeypatch):
    """bf16, every product tiled, whole trees verified, seeded: sampling through a top-k cut (after a temperature,
    with top-p and min-p after it) reads the lm_head screen's columns instead of the whole logits and draws the tokens
    the whole logits give. A repetition penalty before the cut reads every logit: the screen is not asked. A screen whose first
    columns in a process miss one the cut keeps is not used again, with a warning. The forwards that check the lean
    forward and the screen (a process's first) are no step's cost."""
    import clover_hf.base.lean_layers as lean
    from clover_hf import CostModel, DraftBudget

    from .tiny import prompt, random_heads

    screened = []
    real = bf16_kernel.Screen.top_k
    monkeypatch.setattr(bf16_kernel.Screen, "top_k", lambda self, x, k: screened.append(x.shape[0]) or real(self, x, k))
    base = tiny_model(arch, dtype=torch.bfloat16, head_dim=32)
    clover, _ = random_heads(base, lookup_tokens=3)
    clover = clover.to(torch.bfloat16)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)  # the whole tree every step
    forms = {1 << k: TILED for k in range(9)}

    def run(**kwargs):
        torch.manual_seed(7)
        return clover.generate(prompt(4), max_new_tokens=24, do_sample=True, temperature=0.8, top_k=6, top_p=0.9,
                               min_p=0.02, budget=DraftBudget(costs=costs, forms=forms), **kwargs)

    settled = _verify_settled(monkeypatch)
    got = run()
    assert len(screened) > 5 and max(screened) > 2 and clover.generation_stats.verified_per_step > 2
    # the forwards that checked the lean forward, then made the screen and checked its first choices (a process's
    # first of each) are no step's cost
    assert settled[:2] == [False, False] and all(settled[2:])
    screened.clear()
    monkeypatch.setattr(lean._ModelForward, "_top_k", lambda self, normed, k: None)
    assert torch.equal(got, run()) and not screened
    monkeypatch.undo()
    monkeypatch.setattr(bf16_kernel.Screen, "top_k", lambda self, x, k: screened.append(x.shape[0]) or real(self, x, k))
    run(repetition_penalty=1.3)
    assert not screened

    # a screen whose first columns in a process miss one the cut keeps is not used again, with a warning
    monkeypatch.setattr(lean.VERDICTS, "screens", {})
    monkeypatch.setattr(bf16_kernel.Screen, "top_k", lambda self, x, k: screened.append(x.shape[0]) or tuple(
        t[..., 1:] for t in real(self, x, k)))
    with pytest.warns(UserWarning, match="differed"):
        assert torch.equal(run(), got)
    assert len(screened) == 1 and list(lean.VERDICTS.screens.values()) == [False]

    # columns whose logits hold a NaN leave nothing to sample from: an error, not a draw from the whole logits
    monkeypatch.setattr(lean.VERDICTS, "screens", {})
    monkeypatch.setattr(bf16_kernel.Screen, "top_k", real)
    monkeypatch.setattr(decoding, "sample_columns", lambda *args: None)
    with pytest.raises(RuntimeError, match="NaN"):
        run()


@needs_kernel
def test_batched_sampling_through_the_screen_draws_what_the_whole_logits_draw(monkeypatch):
    """A batch's rows share the screen's columns (those any of its tokens may take): seeded, two rows sampled through
    a top-k cut draw the tokens the whole logits give."""
    import clover_hf.base.lean_layers as lean
    from clover_hf import CostModel, DraftBudget

    from .tiny import prompt, random_heads

    screened = []
    real = bf16_kernel.Screen.top_k
    monkeypatch.setattr(bf16_kernel.Screen, "top_k", lambda self, x, k: screened.append(x.shape[0]) or real(self, x, k))
    base = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    clover, _ = random_heads(base, lookup_tokens=3)
    clover = clover.to(torch.bfloat16)
    costs = CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0)
    forms = {1 << k: TILED for k in range(9)}
    ids = torch.cat([prompt(4), prompt(5)])

    def run():
        torch.manual_seed(7)
        return clover.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=True,
                               temperature=0.8, top_k=6, pad_token_id=0, budget=DraftBudget(costs=costs, forms=forms))

    got = run()
    assert screened and max(screened) > 2  # rows of both texts, several tokens each
    monkeypatch.setattr(lean._ModelForward, "_top_k", lambda self, normed, k: None)
    assert torch.equal(got, run())


@pytest.mark.parametrize("isa", BUILDS)
def test_the_screens_int8_copy_and_norms_bound_what_they_claim(isa, built, monkeypatch):
    """Each column's int8 weights (tiled as the screen reads them) are w / scale rounded (w times 1 / scale in float32:
    within 1e-4 of half a step), scale its largest magnitude / 127, and the norms of w - scale q and of w no smaller
    than float64's (nor more than a float32 step over), for input sizes with and without a remainder past blocks of 8;
    a weight not finite in that remainder declines too."""
    monkeypatch.setattr(KERNEL, "lib", built(isa))
    torch.manual_seed(0)
    for in_features in (576, 10, 6):
        weight = (torch.randn(64, in_features) * torch.logspace(-3, 1, 64)[:, None]).bfloat16()
        screen = bf16_kernel.Screen.of(weight, None)
        q = screen.tiled.transpose(1, 2).reshape(64, in_features).double()
        w, scale = weight.double(), screen.scales.double()
        assert torch.equal(screen.scales, (weight.float().abs().amax(1) / 127))
        assert ((q - w / scale[:, None]).abs() <= 0.5 + 1e-4).all() and q.abs().max() <= 127
        for got, want in ((screen.resid, (w - scale[:, None] * q).norm(dim=1)), (screen.norms, w.norm(dim=1))):
            assert (got.double() >= want).all() and (got.double() <= want * (1 + 2.0 ** -22) + 1e-30).all()
    broken = torch.randn(32, 10).bfloat16()
    broken[3, 9] = float("-inf")
    assert bf16_kernel.Screen.of(broken, None) is None
