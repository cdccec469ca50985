"""The heads shipped for SmolLM2-135M-Instruct: exact in float32, and they really draft well."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from clover_hf import CloverForCausalLM, CostModel
from clover_hf.embedded import load_default, shipped_heads_path
from clover_hf.training.data import mtbench_questions

NEW = 32  # new tokens per prompt: enough for several multi-token steps
STEEP = CostModel.from_function(lambda rows, width: 40.0 * width, draft_ms=3.0)  # each token costs a forward


@pytest.fixture(scope="module")
def shipped(converted) -> CloverForCausalLM:
    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(converted), dtype=torch.float32)
    assert model.clover_config.base_model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    return model


@pytest.fixture(scope="module")
def tok(converted):
    return AutoTokenizer.from_pretrained(converted)


@pytest.fixture(scope="module")
def reference(shipped, tok):
    """Plain greedy `generate` of the base on MT-Bench question i, computed once per module."""
    done: dict[int, torch.Tensor] = {}

    def get(i: int) -> torch.Tensor:
        if i not in done:
            done[i] = shipped.base_model.generate(_chat(tok, i), max_new_tokens=NEW, do_sample=False)
        return done[i]

    return get


def _chat(tok, i: int) -> torch.Tensor:
    return tok.apply_chat_template([{"role": "user", "content": mtbench_questions()[i]}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=False)


def _rate(model: CloverForCausalLM, tok, questions, check=None, **kwargs) -> float:
    """New tokens per base forward over `questions`; each output checked against `check(i)` if given."""
    steps = tokens = 0
    for i in questions:
        out = model.generate(_chat(tok, i), max_new_tokens=NEW, **kwargs)
        if check is not None:
            assert torch.equal(out, check(i)), i
        steps, tokens = steps + model.generation_stats.steps, tokens + model.generation_stats.new_tokens
    return tokens / steps


def test_shipped_heads_are_exact_and_accept_long_paths(shipped, tok, reference):
    rate = _rate(shipped, tok, (1, 2), reference, do_sample=False, budget="full")
    # measured (32 tokens each): 2.67 and 1.52 tokens per forward; fresh heads with the same lookup chain, 1.10
    # (MT-Bench questions 0-2)
    assert rate > 1.35, rate


def test_shipped_heads_draft_well_when_sampling(shipped, tok):
    """Sampling is lossless whatever the drafts; trained heads make it take fewer base forwards."""
    torch.manual_seed(0)
    rate = _rate(shipped, tok, (3, 4), do_sample=True, temperature=0.7, budget="full")
    # measured (32 tokens each): 1.45 tokens per forward; fresh heads with the same lookup chain, 1.02 (questions 3-5)
    assert rate > 1.25, rate


def test_load_default(cache_root, monkeypatch):
    monkeypatch.setenv("CLOVER_HF_CACHE", str(cache_root))
    model, tok = load_default(torch.bfloat16)
    assert model.base_model.dtype == torch.bfloat16 and model.clover_heads.heads[0].fc.weight.dtype == torch.bfloat16
    ids = tok("Hello", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(out[:, : ids.shape[1]], ids) and out.shape == (1, ids.shape[1] + 8)
    assert model.generation_stats.new_tokens == 8


def test_shipped_heads_exact_on_a_padded_batch(shipped, tok):
    """Three MT-Bench prompts of different lengths, left-padded into one batch: every row equals the
    base's batched generate, and the rows verify their trees in shared forwards."""
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in mtbench_questions()[6:9]]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert not batch["attention_mask"].all()  # padding is exercised
    expected = shipped.base_model.generate(**batch, max_new_tokens=24, do_sample=False)
    assert torch.equal(shipped.generate(**batch, max_new_tokens=24, do_sample=False, budget="full"), expected)
    stats = shipped.generation_stats
    # measured with 32 tokens: 96 tokens in 25 forwards, 3.8 per forward across the three rows (1.3 per row)
    assert stats.new_tokens / stats.steps > 3.0, (stats.new_tokens, stats.steps)


def test_shipped_medusa_baseline_is_exact_and_drafts(shipped, tok, reference):
    """The Medusa baseline shipped beside Clover's heads: exact in float32, and its heads alone (no
    lookup chain) accept drafts. How it compares with Clover is a benchmark's question (BENCHMARKS.md)."""
    medusa = CloverForCausalLM.from_pretrained(shipped_heads_path("medusa"), base_model=shipped.base_model)
    assert medusa.clover_config.head_type == "medusa" and medusa.clover_config.lookup_tokens == 0
    rate = _rate(medusa, tok, (1, 2), reference, do_sample=False, budget="full")
    assert rate > 1.25, rate  # measured (32 tokens each): 1.45 and 1.39


def test_shipped_heads_under_a_budget_are_exact_and_follow_the_costs(shipped, tok, reference):
    """The default budget with the trained heads: where verifying is nearly free (a GPU-like cost
    curve) it verifies wide trees and accepts long paths; where each token costs a forward (steeper
    than any CPU measured) it decodes plainly. The output is the base's either way."""
    cheap = CostModel.from_function(lambda rows, width: 40.0 + 0.5 * width, draft_ms=3.0)
    ids, expected = _chat(tok, 9), reference(9)
    assert torch.equal(shipped.generate(ids, max_new_tokens=NEW, do_sample=False, budget=cheap), expected)
    wide = shipped.generation_stats
    assert torch.equal(shipped.generate(ids, max_new_tokens=NEW, do_sample=False, budget=STEEP), expected)
    plain = shipped.generation_stats
    assert wide.verified_per_step > 4 and wide.tokens_per_step > 1.4, (wide.verified_per_step, wide.tokens_per_step)
    assert plain.verified_per_step == 1.0 and plain.tokens_per_step == 1.0


def test_plain_steps_in_bf16_are_plain_decoding_bit_for_bit(converted, tok):
    """Where the budget verifies nothing drafted, Clover's steps are the base's own 1-token forwards, mask
    path included: in bf16 an explicit additive mask rounds differently at some cache lengths, and the
    output drifted from plain `generate` within 64 tokens on each of these prompts."""
    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(converted), dtype=torch.bfloat16)
    for i in range(3):
        ids = _chat(tok, i)
        expected = model.base_model.generate(ids, max_new_tokens=64, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=64, do_sample=False, budget=STEEP), expected), i
        assert model.generation_stats.verified_per_step == 1.0


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_shipped_heads_on_a_static_cache_are_exact(shipped, tok, reference, compiled):
    """A static cache, eager and with the verify forward compiled by inductor (transformers' CPU switch for
    compiling): float32 greedy output is the base's, and the whole tree verifies several tokens a step."""
    from transformers import CompileConfig

    kwargs = {"cache_implementation": "static"}
    if compiled:
        config = CompileConfig(mode="default")
        config._compile_all_devices = True
        kwargs["compile_config"] = config
    rate = _rate(shipped, tok, (1, 2), reference, do_sample=False, budget="full", **kwargs)
    assert shipped.generation_stats.verified_per_step > 1
    assert rate > 1.35, rate  # as on a dynamic cache (test_shipped_heads_are_exact_and_accept_long_paths)
