"""The heads shipped for SmolLM2-135M-Instruct: exact in float32, and they really draft well."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from clover_hf import CloverForCausalLM
from clover_hf.data import mtbench_questions
from clover_hf.embedded import load_default, shipped_heads_path


def _shipped_and_untrained(converted) -> tuple[CloverForCausalLM, CloverForCausalLM, AutoTokenizer]:
    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(converted), dtype=torch.float32)
    assert model.clover_config.base_model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    torch.manual_seed(0)
    untrained = CloverForCausalLM.from_base(
        model.base_model,
        lookup_tokens=model.clover_config.lookup_tokens,
        lookup_max_tokens=model.clover_config.lookup_max_tokens,
    )
    return model, untrained, AutoTokenizer.from_pretrained(converted)


def _chat(tok, question: str) -> torch.Tensor:
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=False)


def test_shipped_heads_are_exact_and_accept_long_paths(converted):
    model, untrained, tok = _shipped_and_untrained(converted)
    rates = []
    for clover in (model, untrained):
        steps = tokens = 0
        for question in mtbench_questions()[:3]:
            ids = _chat(tok, question)
            expected = clover.base_model.generate(ids, max_new_tokens=48, do_sample=False)
            out = clover.generate(ids, max_new_tokens=48, do_sample=False, budget="full")
            assert torch.equal(out, expected)
            steps, tokens = steps + clover.generation_stats.steps, tokens + clover.generation_stats.new_tokens
        rates.append(tokens / steps)
    # measured (stage-6 heads, same lookup chain for both): shipped 1.71 (144 tokens in 84 forwards), untrained 1.11
    assert rates[0] > 1.25 and rates[0] > rates[1] + 0.2, rates


def test_shipped_heads_draft_well_when_sampling(converted):
    """Sampling is lossless whatever the drafts; trained heads make it take fewer base forwards."""
    model, untrained, tok = _shipped_and_untrained(converted)
    rates = []
    for clover in (model, untrained):
        steps = tokens = 0
        torch.manual_seed(0)
        for question in mtbench_questions()[3:6]:
            clover.generate(_chat(tok, question), max_new_tokens=48, do_sample=True, temperature=0.7, budget="full")
            steps, tokens = steps + clover.generation_stats.steps, tokens + clover.generation_stats.new_tokens
        rates.append(tokens / steps)
    # measured (stage-6 heads): shipped 1.48 tokens per forward (144 in 97), untrained 1.04
    assert rates[0] > 1.2 and rates[0] > rates[1] + 0.15, rates


def test_load_default(cache_root, monkeypatch):
    monkeypatch.setenv("CLOVER_HF_CACHE", str(cache_root))
    model, tok = load_default(torch.bfloat16)
    assert model.base_model.dtype == torch.bfloat16 and model.clover_heads.heads[0].fc.weight.dtype == torch.bfloat16
    ids = tok("Hello", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=5, do_sample=False).shape == (1, ids.shape[1] + 5)


def test_shipped_heads_exact_on_a_padded_batch(converted):
    """Three MT-Bench prompts of different lengths, left-padded into one batch: every row equals the
    base's batched generate, and the rows verify their trees in shared forwards."""
    model, _, tok = _shipped_and_untrained(converted)
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in mtbench_questions()[6:9]]
    batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert not batch["attention_mask"].all()  # padding is exercised
    expected = model.base_model.generate(**batch, max_new_tokens=48, do_sample=False)
    out = model.generate(**batch, max_new_tokens=48, do_sample=False, budget="full")
    assert torch.equal(out, expected)
    stats = model.generation_stats
    # measured (stage-6 heads): 144 tokens in 35 forwards, 4.1 per forward across the three rows (1.64 per row)
    assert stats.new_tokens / stats.steps > 3.0, (stats.new_tokens, stats.steps)


def test_shipped_medusa_baseline_is_exact_and_drafts_worse_than_clover(converted):
    """The Medusa baseline shipped beside Clover's heads: exact in float32, and with the heads alone
    (no lookup chain, each with its own 10-node tree) it takes more base forwards than Clover."""
    medusa = CloverForCausalLM.from_pretrained(shipped_heads_path("medusa"), base_model=str(converted),
                                               dtype=torch.float32)
    assert medusa.clover_config.head_type == "medusa" and medusa.clover_config.lookup_tokens == 0
    clover = CloverForCausalLM(medusa.base_model, CloverForCausalLM.from_pretrained(
        shipped_heads_path(), base_model=medusa.base_model).clover_heads)
    tok = AutoTokenizer.from_pretrained(converted)
    rates = []
    for model in (clover, medusa):
        steps = tokens = 0
        for question in mtbench_questions()[:3]:
            ids = _chat(tok, question)
            out = model.generate(ids, max_new_tokens=48, do_sample=False, lookup=0, budget="full")
            assert torch.equal(out, model.base_model.generate(ids, max_new_tokens=48, do_sample=False))
            steps, tokens = steps + model.generation_stats.steps, tokens + model.generation_stats.new_tokens
        rates.append(tokens / steps)
    # measured: Clover 1.58 tokens per forward (144 in 91), Medusa 1.44 (144 in 100)
    assert rates[1] > 1.25 and rates[0] > rates[1] + 0.05, rates


def test_shipped_heads_under_a_budget_are_exact_and_follow_the_costs(converted):
    """The default budget with the trained heads: where verifying is nearly free (a GPU-like cost
    curve) it verifies wide trees and accepts long paths; where each token costs a forward (steeper
    than any CPU measured) it decodes plainly. The output is the base's either way."""
    from clover_hf import CostModel

    model, _, tok = _shipped_and_untrained(converted)
    cheap = CostModel.from_function(lambda rows, width: 40.0 + 0.5 * width, draft_ms=3.0)
    steep = CostModel.from_function(lambda rows, width: 40.0 * width, draft_ms=3.0)
    ids = _chat(tok, mtbench_questions()[9])
    expected = model.base_model.generate(ids, max_new_tokens=48, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=48, do_sample=False, budget=cheap), expected)
    wide = model.generation_stats
    assert torch.equal(model.generate(ids, max_new_tokens=48, do_sample=False, budget=steep), expected)
    plain = model.generation_stats
    assert wide.verified_per_step > 4 and wide.tokens_per_step > 1.4, (wide.verified_per_step, wide.tokens_per_step)
    assert plain.verified_per_step == 1.0 and plain.tokens_per_step == 1.0
