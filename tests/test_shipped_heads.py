"""The heads shipped for SmolLM2-135M-Instruct: exact in float32, and they really draft well."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from clover_hf import CloverForCausalLM
from clover_hf.data import mtbench_questions
from clover_hf.embedded import load_default, shipped_heads_path


def test_shipped_heads_are_exact_and_accept_long_paths(converted):
    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(converted), dtype=torch.float32)
    assert model.clover_config.base_model_name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    tok = AutoTokenizer.from_pretrained(converted)
    torch.manual_seed(0)
    untrained = CloverForCausalLM.from_base(model.base_model)
    rates = []
    for clover in (model, untrained):
        steps = tokens = 0
        for question in mtbench_questions()[:3]:
            ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=False)
            expected = clover.base_model.generate(ids, max_new_tokens=48, do_sample=False)
            out = clover.generate(ids, max_new_tokens=48, do_sample=False)
            assert torch.equal(out, expected)
            steps, tokens = steps + clover.generation_stats.steps, tokens + clover.generation_stats.new_tokens
        rates.append(tokens / steps)
    # measured: 1.37 tokens per forward (144 in 105) for the shipped heads
    assert rates[0] > 1.25 and rates[0] > rates[1] + 0.2, rates


def test_load_default(cache_root, monkeypatch):
    monkeypatch.setenv("CLOVER_HF_CACHE", str(cache_root))
    model, tok = load_default(torch.bfloat16)
    assert model.base_model.dtype == torch.bfloat16 and model.clover_heads.heads[0].fc.weight.dtype == torch.bfloat16
    ids = tok("Hello", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=5, do_sample=False).shape == (1, ids.shape[1] + 5)
