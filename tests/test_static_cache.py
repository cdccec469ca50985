"""Clover on a static cache, eager and with a compiled verify forward: the base's own output, a bounded
number of compilations, and the base's own `generate` where a static cache cannot hold a tree."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import CompileConfig, DynamicCache, GenerationConfig, StaticCache

from clover_hf import CloverForCausalLM, DraftBudget
from clover_hf.base import verify_forward
from clover_hf.base.cache import OUTPUT_CACHE_FIELD
from clover_hf.base.verify_forward import BUCKETS, bucket, compile_settings

from .test_decoding import DRAFTING
from .tiny import left_padded, oracle_model, prompt, same, tiny_model

STATIC_ARCHS = ["llama", "qwen2", "qwen3", "phi3", "gpt2"]  # the tiny architectures without sliding windows


class CountingBackend:
    """A torch.compile backend that runs the captured graph as it is and counts the graphs compiled."""

    def __init__(self) -> None:
        self.graphs = 0
        self.__name__ = "counting"

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def on_cpu(backend="aot_eager") -> CompileConfig:
    """transformers' own switch for compiling on a CPU, with a backend that compiles quickly."""
    config = CompileConfig(backend=backend)
    config._compile_all_devices = True
    return config


COMPILE = {"eager": {}, "compiled": {"compile_config": on_cpu()}}


def clover_ran(model: CloverForCausalLM) -> bool:
    return model.generation_stats is not None and model.generation_stats.steps > 0


@pytest.mark.parametrize("compile", list(COMPILE))
@pytest.mark.parametrize("arch", STATIC_ARCHS)
def test_oracle_heads_on_a_static_cache_give_the_base_output(arch, compile):
    """Long accepted paths, other branches and bonus tokens: the tree written at the next slots and the
    accepted path moved by an index copy give plain `generate`'s output token for token."""
    base = tiny_model(arch)
    ids = prompt(3, length=9)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to the base's generate
        out = clover.generate(ids, max_new_tokens=40, do_sample=False, cache_implementation="static",
                              **COMPILE[compile])
    assert same(out, ref)
    stats = clover.generation_stats
    assert stats.verified_per_step > 1 and max(stats.accepted_lengths) >= 3  # Clover really ran, long paths kept


@pytest.mark.parametrize("drafting", list(DRAFTING))
@pytest.mark.parametrize("compile", list(COMPILE))
def test_random_heads_on_a_static_cache_give_the_base_output(drafting, compile):
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(1)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    out = clover.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="static", budget="full",
                          **DRAFTING[drafting], **COMPILE[compile])
    assert same(out, ref)
    assert clover.generation_stats.verified_per_step > 1


@pytest.mark.parametrize("compile", list(COMPILE))
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_left_padded_batch_on_a_static_cache(arch, compile):
    """Rows accept paths of different lengths and one stops early at its eos: masked slots, repacking and a
    row leaving the batch, all over a static cache."""
    base = tiny_model(arch)
    ids, mask, pads = left_padded(prompt(1, length=10), prompt(2, length=6), prompt(3, length=8))
    free = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    eos = int(free[1, ids.shape[1] + 5])  # row 1 stops there (or earlier, where the token comes sooner)
    settings = dict(attention_mask=mask, max_new_tokens=40, do_sample=False, eos_token_id=eos, pad_token_id=0)
    ref = base.generate(ids, **settings)
    assert (ref == eos).any(dim=1).tolist().count(True) >= 1 and ref.shape[1] > ids.shape[1] + 6
    clover = oracle_model(base, free, pads)
    out = clover.generate(ids, cache_implementation="static", **settings, **COMPILE[compile])
    assert same(out, ref)
    assert clover_ran(clover)


def test_sampling_with_top_k_1_on_a_static_compiled_cache_is_greedy():
    base = tiny_model("qwen2")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=4)
    ids = prompt(2)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    out = clover.generate(ids, max_new_tokens=30, do_sample=True, top_k=1, budget="full",
                          cache_implementation="static", compile_config=on_cpu())
    assert same(out, ref) and clover_ran(clover)


def test_compilations_are_bounded_by_the_buckets_and_kept_across_calls():
    """Each width bucket compiles once, in whichever call first uses it: later calls compile no shape again."""
    backend = CountingBackend()
    base = tiny_model("llama")
    ids = prompt(5)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref)
    settings = dict(max_new_tokens=40, do_sample=False, cache_implementation="static", compile_config=on_cpu(backend))
    trees = [{}, {"tree": [[0], [0, 0]], "lookup": 1}]  # the whole tree with its chain; a 4-node tree
    for _ in range(2):
        for kwargs in trees:
            assert same(clover.generate(ids, **settings, **kwargs), ref)
        shapes = next(iter(verify_forward._COMPILED[base].values())).shapes
        assert backend.graphs == len(shapes)  # one graph per shape called, none compiled twice
    widths = {ids_shape[1] for ids_shape, _ in shapes}
    assert widths <= set(BUCKETS) and len(widths) >= 2  # padded to buckets, more than one of them used


def test_shapes_past_the_limit_run_eager(monkeypatch):
    monkeypatch.setattr(verify_forward, "BUCKETS", (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 64))
    monkeypatch.setattr(verify_forward, "MAX_SHAPES", 3)
    backend = CountingBackend()
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=2)
    ids = prompt(6)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    for tree in ([[0]], [[0], [0, 0]], [[0], [1], [0, 0]], [[0], [1], [2], [0, 0]], None):
        out = clover.generate(ids, max_new_tokens=40, do_sample=False, budget="full", tree=tree,
                              cache_implementation="static", compile_config=on_cpu(backend))
        assert same(out, ref)
    compiled = next(iter(verify_forward._COMPILED[base].values()))
    assert len(compiled.calls) > 3 and len(compiled.shapes) == 3  # more shapes were called than may compile
    assert backend.graphs == 3


def test_a_dynamic_cache_again_in_the_next_call():
    base = tiny_model("llama")
    ids = prompt(7)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = oracle_model(base, ref)
    static = clover.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="static",
                             compile_config=on_cpu(), return_dict_in_generate=True)
    cache = getattr(static, OUTPUT_CACHE_FIELD)
    assert isinstance(cache, StaticCache) and int(cache.get_seq_length()) == ref.shape[1] - 1
    with torch.no_grad():  # the returned cache goes on as plain decoding would: in place, outside inference mode
        step = base(ref[:, -1:], cache=cache, position_ids=torch.tensor([[ref.shape[1] - 1]]))
        assert torch.allclose(step.logits[0, -1], base(ref).logits[0, -1], atol=1e-5)
    dynamic = clover.generate(ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
    assert isinstance(getattr(dynamic, OUTPUT_CACHE_FIELD), DynamicCache)
    assert same(static.sequences, ref) and same(dynamic.sequences, ref) and clover_ran(clover)


def test_the_callers_own_static_cache_is_filled_and_goes_on_decoding():
    """An empty StaticCache passed in: Clover fills it with the text, and it stays usable outside the call."""
    base = tiny_model("llama")
    ids = prompt(8)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    clover = oracle_model(base, ref)
    cache = StaticCache(config=base.config, max_cache_len=64)
    out = clover.generate(ids, max_new_tokens=20, do_sample=False, cache=cache)
    assert same(out, ref) and clover_ran(clover)
    assert int(cache.get_seq_length()) == out.shape[1] - 1  # every token but the last is cached
    with torch.no_grad():  # as plain decoding goes on with it: in place, outside inference mode
        step = base(out[:, -1:], cache=cache, position_ids=torch.tensor([[out.shape[1] - 1]]))
        full = base(out)
    assert torch.allclose(step.logits[0, -1], full.logits[0, -1], atol=1e-5)


def test_a_callers_static_cache_of_just_the_texts_length_verifies_narrower_at_its_end():
    base = tiny_model("llama")
    ids = prompt(9)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = oracle_model(base, ref)
    cache = StaticCache(config=base.config, max_cache_len=ids.shape[1] + 30)
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, cache=cache), ref) and clover_ran(clover)


@pytest.mark.parametrize("arch", ["mistral", "gemma3_text"])
def test_sliding_window_models_fall_back_to_the_base_on_a_static_cache(arch):
    base = tiny_model(arch)
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(2)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False, cache_implementation="static")
    with pytest.warns(UserWarning, match="sliding-window attention layers"):
        out = clover.generate(ids, max_new_tokens=20, do_sample=False, cache_implementation="static")
    assert same(out, ref) and clover.generation_stats is None


@pytest.mark.parametrize("cache, words", [
    (lambda base: DynamicCache(config=base.config), "DynamicCache passed in"),
    (lambda base: StaticCache(config=base.config, max_cache_len=12), "StaticCache of 12 slots for up to 30 tokens"),
])
def test_caches_clover_cannot_fill_go_to_the_base(cache, words):
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(2)
    with pytest.warns(UserWarning, match=words):
        try:
            clover.generate(ids, max_new_tokens=20, do_sample=False, cache=cache(base))
        except Exception:  # the base's own generate may refuse it in turn; Clover only must not decode
            pass
    assert clover.generation_stats is None


def test_offloaded_static_caches_go_to_the_base():
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    with pytest.warns(UserWarning, match="offloaded_static"):
        try:
            clover.generate(prompt(2), max_new_tokens=5, do_sample=False, cache_implementation="offloaded_static")
        except (AssertionError, RuntimeError):  # offloading wants an accelerator, which the base's generate says
            pass
    assert clover.generation_stats is None


def test_compile_follows_transformers_rules_for_generate():
    base = tiny_model("llama")
    static, dynamic = StaticCache(config=base.config, max_cache_len=32), DynamicCache()
    assert compile_settings(base, GenerationConfig(), static) is None  # a CPU compiles only when asked to
    assert compile_settings(base, GenerationConfig(compile_config=on_cpu()), static).backend == "aot_eager"
    assert compile_settings(base, GenerationConfig(compile_config=on_cpu()), dynamic) is None
    assert compile_settings(base, GenerationConfig(compile_config=on_cpu(), disable_compile=True), static) is None


def test_buckets():
    assert [bucket(n) for n in (1, 2, 4, 5, 16, 17, 64, 65, 161)] == [1, 4, 4, 16, 16, 64, 64, 160, 256]
    assert bucket(BUCKETS[-1] + 1) == 2 * BUCKETS[-1]


def test_the_budget_on_a_static_compiled_cache_keys_its_costs_apart():
    """Under "auto" the costs of a compiled static forward are learnt apart from a dynamic cache's, and
    output stays the base's."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False), ref)
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="static",
                                compile_config=on_cpu()), ref)
    keys = list(clover._draft_budget._costs)
    assert any(k.endswith("static compiled aot_eager reduce-overhead") for k in keys)
    assert any("static" not in k for k in keys)


@pytest.mark.parametrize("compile", list(COMPILE))
def test_scores_eos_and_the_streamer_on_a_static_cache(compile):
    """What a user asks of `generate` besides tokens: scores and logits, an eos inside an accepted path, the
    streamer, as on a dynamic cache."""
    import contextlib
    import io

    from transformers import TextStreamer

    from .tiny import byte_tokenizer

    base = tiny_model("llama")
    ids = prompt(10)
    kw = dict(max_new_tokens=20, do_sample=False, return_dict_in_generate=True, output_scores=True,
              output_logits=True, repetition_penalty=1.3)
    ref = base.generate(ids, **kw)
    clover = oracle_model(base, ref.sequences)
    out = clover.generate(ids, cache_implementation="static", **kw, **COMPILE[compile])
    assert same(out.sequences, ref.sequences) and len(out.scores) == 20
    for a, b in zip(out.scores + out.logits, ref.scores + ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    eos = int(ref.sequences[0, ids.shape[1] + 7])
    plain = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos)
    assert same(clover.generate(ids, cache_implementation="static", **plain, **COMPILE[compile]),
                base.generate(ids, **plain))
    printed = []
    for model in (base, clover):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            model.generate(ids, max_new_tokens=20, do_sample=False, cache_implementation="static",
                           streamer=TextStreamer(byte_tokenizer(), skip_prompt=True))
        printed.append(buf.getvalue())
    assert printed[0] == printed[1] and printed[0].strip()


def test_a_static_cache_multiplies_in_the_forms_learnt_for_the_machine(monkeypatch, tmp_path):
    """How linear layers multiply is the machine's, whatever the cache: a static call takes the forms the dynamic
    cache's call learnt from its products (none timed apart) and learns verify costs of its own under them."""
    import clover_hf.cpu

    timed = []
    real = clover_hf.cpu.faster_forms
    monkeypatch.setattr(clover_hf.cpu, "faster_forms", lambda *a, **k: timed.append(1) or real(*a, **k))
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    ids = prompt(4)
    ref = base.generate(ids, max_new_tokens=20, do_sample=False)
    budget = DraftBudget(cache_dir=tmp_path)  # nothing stored yet
    for kwargs in ({}, {"cache_implementation": "static"}):
        assert same(clover.generate(ids, max_new_tokens=20, do_sample=False, budget=budget, **kwargs), ref)
    costs = budget._costs
    dynamic, static = (next(c for k, c in costs.items() if k.endswith(end)) for end in ("copies", "static eager"))
    assert not timed and static.basis is not None and static.ms and static.ms is not dynamic.ms


def test_a_torch_compile_without_per_function_limits_still_compiles_the_verify_forward(monkeypatch):
    """torch.compile before 2.13 takes no `recompile_limit`: the verify forward compiles without it (dynamo's
    global limit applies) and gives the base's output, where passing it raised a TypeError."""
    assert "recompile_limit" in verify_forward._recompile_options()  # this torch takes it: passed
    compile_fn, seen = torch.compile, []

    def older_compile(model, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                      disable=False):
        seen.append(backend)
        return compile_fn(model, fullgraph=fullgraph, dynamic=dynamic, backend=backend, mode=mode, options=options,
                          disable=disable)

    monkeypatch.setattr(torch, "compile", older_compile)
    base = tiny_model("llama")
    ids = prompt(3, length=9)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    clover = oracle_model(base, ref)
    out = clover.generate(ids, max_new_tokens=30, do_sample=False, cache_implementation="static",
                          compile_config=on_cpu())
    assert same(out, ref)
    assert seen == ["aot_eager"] and clover.generation_stats.verified_per_step > 1
