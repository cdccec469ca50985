"""Quantized bases (torchao, bitsandbytes): Clover decodes them exactly in fp32, drafts from their lm_head,
and leaves their quantized layers to their own forwards."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from clover_hf import CloverForCausalLM
from clover_hf.core.quantized import TORCHAO_CONFIGS, dense, nbytes, quantization, quantize_base
from clover_hf.cpu.linears import _linears, faster_forms
from clover_hf.backends import cost_key

from .tiny import check_stats, oracle_model, prompt, random_heads, same, save_tiny_base, tiny_model

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

CONFIGS = TORCHAO_CONFIGS


def quantized_tiny(arch: str, config: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    base = tiny_model(arch, dtype=dtype)
    quantize_base(base, config)
    return base


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3"])
def test_torchao_bases_decode_exactly(arch, config):
    base = quantized_tiny(arch, config)
    assert "torchao" in quantization(base)
    assert _linears(base) == []  # every layer is quantized: the budget's forms leave them all alone
    clover, _ = random_heads(base, draft_vocab_size=64)
    for budget in ("auto", "full"):
        clover.budget = budget
        for seed in (1, 2):
            ids = prompt(seed)
            ref = base.generate(ids, max_new_tokens=30, do_sample=False)
            assert same(clover.generate(ids, max_new_tokens=30, do_sample=False), ref)
            check_stats(clover.generation_stats, new_tokens=30)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_torchao_base_verifies_whole_trees(config):
    base = quantized_tiny("llama", config)
    ids = prompt(3, length=6)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref)
    assert same(clover.generate(ids, max_new_tokens=40, do_sample=False), ref)
    assert clover.generation_stats.tokens_per_step > 1.5


@pytest.mark.parametrize("config", list(CONFIGS))
def test_bf16_quantized_lm_head_gives_bf16_draft_rows(config):
    """The draft rows are the quantized lm_head read back, in bf16."""
    base = quantized_tiny("llama", config, torch.bfloat16)
    clover, _ = random_heads(base, draft_vocab_size=64)
    clover.generate(prompt(4), max_new_tokens=20, do_sample=False, budget="full")  # drafting every step
    check_stats(clover.generation_stats, new_tokens=20)
    rows = clover.clover_heads._lm_head_rows[-1]
    assert rows.weight.dtype == torch.bfloat16 and rows.weight.shape == (64, base.config.hidden_size)
    read_back = dense(base.get_output_embeddings().weight)
    assert type(read_back) is torch.Tensor and read_back.dtype == torch.bfloat16
    ids = clover.clover_heads.draft_token_ids
    assert torch.equal(rows.weight, read_back[ids])


def test_partly_quantized_base_keeps_forms_for_its_plain_layers():
    base = tiny_model("llama")
    quantize_(base, Int8WeightOnlyConfig(), filter_fn=lambda m, name: isinstance(m, nn.Linear) and "lm_head" not in name)
    assert _linears(base) == [base.get_output_embeddings()]
    forms = faster_forms([base])  # times the plain layer alone, and does not fail on the others
    assert all(isinstance(n, int) and isinstance(f, str) for n, f in forms.items())
    clover, _ = random_heads(base, draft_vocab_size=64)
    ids = prompt(5)
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False),
                base.generate(ids, max_new_tokens=30, do_sample=False))


def test_quantized_weights_hold_fewer_bytes():
    base, plain_base = quantized_tiny("llama", "int8"), tiny_model("llama")
    weight, plain_weight = base.model.layers[0].mlp.up_proj.weight, plain_base.model.layers[0].mlp.up_proj.weight
    assert nbytes(plain_weight) == plain_weight.numel() * 4
    assert plain_weight.numel() <= nbytes(weight) < 1.2 * plain_weight.numel()  # int8 values and a scale per row
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize_base(base, "int3")


def test_quantization_is_part_of_the_cost_key():
    plain_base, base = tiny_model("llama"), quantized_tiny("llama", "int8")
    cpu = torch.device("cpu")
    assert quantization(plain_base) is None
    assert cost_key(base, cpu) == cost_key(plain_base, cpu) + "|torchao Int8Tensor"


def test_unreadable_lm_head_is_refused_before_any_forward():
    """A quantization Clover cannot read back is named, with what works, when the model is built."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=64)
    lm_head = base.get_output_embeddings()
    lm_head.weight = nn.Parameter(torch.zeros(lm_head.weight.shape, dtype=torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match=r"lm_head weight.*torch Parameter \(torch.int8\).*unquantized"):
        CloverForCausalLM(base, clover.clover_heads)


def bnb_tiny(tmp_path, bits: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_8bit=True) if bits == 8 else BitsAndBytesConfig(load_in_4bit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(save_tiny_base(tmp_path), quantization_config=config,
                                                    device_map="cpu").eval()


def test_bitsandbytes_4bit_base_decodes_exactly(tmp_path):
    base = bnb_tiny(tmp_path, 4)
    assert quantization(base) == "bitsandbytes Params4bit"
    clover, _ = random_heads(base, draft_vocab_size=64)
    ids = prompt(6)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False), ref)
    clover = oracle_model(base, ref)
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=False), ref)
    assert clover.generation_stats.tokens_per_step > 1.5


def test_bitsandbytes_8bit_base_decodes(tmp_path):
    """LLM.int8() rounds a many-token forward differently from one-token decoding (as bf16 does): its
    output is not compared, only that Clover decodes the base and reads its lm_head."""
    base = bnb_tiny(tmp_path, 8)
    assert quantization(base) == "bitsandbytes Int8Params"
    clover, _ = random_heads(base, draft_vocab_size=64)
    clover.budget = "full"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = clover.generate(prompt(7), max_new_tokens=20, do_sample=False)
    assert out.shape == (1, prompt(7).shape[1] + 20)
    check_stats(clover.generation_stats, new_tokens=20)


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_weights_read_back(tmp_path, bits):
    """What the Augmenting Block copies from the base's last layer: the quantized weight read back."""
    base, original = bnb_tiny(tmp_path, bits), tiny_model("llama")
    read = dense(base.model.layers[-1].mlp.up_proj.weight)
    want = original.model.layers[-1].mlp.up_proj.weight
    assert read.shape == want.shape and read.is_floating_point()
    error = (read.float() - want).abs().max() / want.abs().max()
    assert 0 < error < (0.2 if bits == 4 else 0.02)
