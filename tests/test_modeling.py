"""The wrapper: construction, save/load, mismatched heads, fallbacks, refused architectures."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, pipeline

from clover_hf import CloverConfig, CloverForCausalLM, CloverHeads
from clover_hf.modeling import check_supported

from .tiny import byte_tokenizer, prompt, tiny_model


@pytest.fixture(scope="module")
def base():
    return tiny_model("llama")


def test_public_attributes_and_passthrough(base):
    clover = CloverForCausalLM.from_base(base, num_heads=3, tree=[[0], [0, 0], [0, 0, 0]])
    assert clover.base_model is base
    assert isinstance(clover.clover_heads, CloverHeads)
    assert clover.clover_config.num_heads == 3
    assert clover.config is base.config and clover.device == base.device  # falls through to the base
    assert clover.get_input_embeddings() is base.get_input_embeddings()
    ids = prompt()
    torch.testing.assert_close(clover(ids).logits, base(ids).logits)
    # the heads hold nothing vocabulary-sized: they borrow the base's embeddings and lm_head
    assert all(base.config.vocab_size not in p.shape for p in clover.clover_heads.parameters())


def test_save_load_round_trip_writes_heads_only(base, tmp_path):
    clover = CloverForCausalLM.from_base(base)
    with torch.no_grad():
        for p in clover.clover_heads.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    clover.save_pretrained(tmp_path / "heads")
    assert sorted(f.name for f in (tmp_path / "heads").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    state = load_file(tmp_path / "heads" / "model.safetensors")
    assert not any(k.startswith(("model.", "lm_head", "transformer.")) for k in state)
    assert sum(t.numel() for t in state.values()) == sum(p.numel() for p in clover.clover_heads.parameters())

    base.save_pretrained(tmp_path / "base")
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "base")
    (tmp_path / "heads" / "config.json").write_text(json.dumps(config))

    ids = prompt(2)
    expected = clover.generate(ids, max_new_tokens=20, do_sample=False, budget="full")  # whole trees: steps match
    loaded = [
        CloverForCausalLM.from_pretrained(tmp_path / "heads"),  # base named by the heads
        CloverForCausalLM.from_pretrained(tmp_path / "heads", base_model=base),
        CloverForCausalLM.from_pretrained(tmp_path / "heads", base_model=str(tmp_path / "base")),
        CloverForCausalLM.from_pretrained(tmp_path / "base", clover_heads=tmp_path / "heads"),
    ]
    for model in loaded:
        for name, tensor in clover.clover_heads.state_dict().items():
            torch.testing.assert_close(model.clover_heads.state_dict()[name], tensor, rtol=0, atol=0)
        assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False, budget="full"), expected)
        assert model.generation_stats.tokens_per_step == pytest.approx(clover.generation_stats.tokens_per_step)


def test_base_kwargs_reach_the_base_loader(base, tmp_path):
    base.save_pretrained(tmp_path / "base")
    CloverForCausalLM.from_base(base).save_pretrained(tmp_path / "heads")
    model = CloverForCausalLM.from_pretrained(tmp_path / "heads", base_model=str(tmp_path / "base"), dtype=torch.bfloat16)
    assert model.base_model.dtype == torch.bfloat16
    assert next(model.clover_heads.parameters()).dtype == torch.bfloat16


def _heads_dir(tmp_path, **overrides):
    config = CloverConfig.for_base(tiny_model("llama").config, **overrides)
    heads = CloverHeads(config)
    from clover_hf.hub.repo import save_heads

    return save_heads(heads, tmp_path / "h")


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(hidden_size=32, num_attention_heads=4), ["hidden_size 32", "64"]),
        (dict(vocab_size=300), ["vocab_size 300", "256"]),
        (dict(base_model_type="gpt2"), ["'gpt2'", "'llama'"]),
    ],
)
def test_mismatched_heads_are_refused(base, tmp_path, overrides, words):
    heads_dir = _heads_dir(tmp_path, **overrides)
    with pytest.raises(ValueError) as err:
        CloverForCausalLM.from_pretrained(heads_dir, base_model=base)
    for word in words:
        assert word in str(err.value)


def test_missing_and_corrupt_weights_name_the_file(base, tmp_path):
    heads_dir = _heads_dir(tmp_path)
    weights = heads_dir / "model.safetensors"
    weights.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        CloverForCausalLM.from_pretrained(heads_dir, base_model=base)
    weights.unlink()
    torch.save({"x": torch.zeros(1)}, heads_dir / "pytorch_model.bin")  # a pickle is never loaded
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        CloverForCausalLM.from_pretrained(heads_dir, base_model=base)


def test_wrong_shapes_in_weights_are_refused(base, tmp_path):
    heads_dir = _heads_dir(tmp_path)
    small = _heads_dir(tmp_path / "x", intermediate_size=32)
    (heads_dir / "model.safetensors").write_bytes((small / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="shape"):
        CloverForCausalLM.from_pretrained(heads_dir, base_model=base)


def test_not_a_heads_dir(base, tmp_path):
    base.save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="clover_heads="):
        CloverForCausalLM.from_pretrained(tmp_path / "base")


def test_bad_config_values():
    with pytest.raises(ValueError, match="divisible"):
        CloverConfig(hidden_size=10, vocab_size=5, num_attention_heads=3)
    with pytest.raises(ValueError, match="depth"):
        CloverConfig(hidden_size=8, vocab_size=5, num_attention_heads=2, num_heads=1, tree=[[0], [0, 0]])
    with pytest.raises(ValueError, match=r"unknown CloverConfig fields \['bogus'\].*pip install -U clover-hf"):
        CloverConfig.from_dict({"hidden_size": 8, "vocab_size": 5, "bogus": 1})


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(do_sample=True, num_beams=2), "beam sample"),
        (dict(num_beams=2), "beam"),
        (dict(num_return_sequences=2, num_beams=2), "beam"),
        (dict(guidance_scale=1.5), "classifier-free guidance"),
    ],
)
def test_unsupported_modes_fall_back_with_one_warning(base, kwargs, reason):
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(3)
    torch.manual_seed(0)
    expected = base.generate(ids, max_new_tokens=10, **kwargs)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = clover.generate(ids, max_new_tokens=10, **kwargs)
    ours = [w for w in caught if "Clover decoding does not support" in str(w.message)]
    assert len(ours) == 1 and reason in str(ours[0].message)
    assert torch.equal(out, expected)
    assert clover.generation_stats is None


def falls_back(clover, *args, **kwargs):
    """clover.generate's output and the reason of its one fallback warning ('' when Clover decoded)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = clover.generate(*args, **kwargs)
    ours = [str(w.message) for w in caught if "Clover decoding does not support" in str(w.message)]
    assert len(ours) <= 1
    return out, ours[0] if ours else ""


def test_model_inputs_clover_cannot_pass_fall_back():
    gpt2 = tiny_model("gpt2")
    ids = prompt(3)
    types = torch.ones_like(ids)  # GPT-2 adds token-type embeddings: the output depends on them
    expected = gpt2.generate(ids, token_type_ids=types, max_new_tokens=10, do_sample=False)
    assert not torch.equal(expected, gpt2.generate(ids, max_new_tokens=10, do_sample=False))
    out, reason = falls_back(CloverForCausalLM.from_base(gpt2), ids, token_type_ids=types, max_new_tokens=10,
                             do_sample=False)
    assert "token_type_ids" in reason and torch.equal(out, expected)


def test_attention_without_tree_masks_falls_back(monkeypatch):
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(3)
    expected = base.generate(ids, max_new_tokens=8, do_sample=False)
    monkeypatch.setattr(base.config, "_attn_implementation", "flash_attention_2")
    calls = []
    monkeypatch.setattr(base, "generate", lambda *a, **k: calls.append(k) or expected)  # no flash kernels on CPU
    out, reason = falls_back(clover, ids, max_new_tokens=8, do_sample=False, clover_profile=True)
    assert "flash_attention_2" in reason and out is expected
    assert calls and "custom_generate" not in calls[0] and "clover_profile" not in calls[0]


def test_dynamic_rope_runs_clover_within_its_original_length_only():
    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=40,
                                  rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(3)
    for new, falls in ((30, False), (50, True)):  # 10 + 30 stays within 40 positions, 10 + 50 does not
        expected = base.generate(ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        out, reason = falls_back(clover, ids, max_new_tokens=new, do_sample=False, pad_token_id=0, lookup=6)
        assert torch.equal(out, expected)
        assert ("'dynamic' past 40 positions" in reason) == falls


def test_stop_strings_from_the_model_defaults_with_an_explicit_config(base):
    from transformers import GenerationConfig

    tok = byte_tokenizer()
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(7)
    free = base.generate(ids, max_new_tokens=30, do_sample=False)
    new = free[0, ids.shape[1] :].tolist()
    k = next(i for i in range(5, len(new) - 1) if all(33 <= t <= 126 for t in new[i : i + 2]))  # printable bytes
    stop = tok.decode(new[k : k + 2])
    config = GenerationConfig(max_new_tokens=30, do_sample=False, pad_token_id=0)
    base.generation_config.stop_strings = [stop]
    try:
        expected = base.generate(ids, generation_config=config, tokenizer=tok)
        out = clover.generate(ids, generation_config=config, tokenizer=tok)
    finally:
        base.generation_config.stop_strings = None
    assert expected.shape[1] < free.shape[1] and torch.equal(out, expected)
    assert clover.generation_stats is not None


def test_positional_arguments_mean_what_they_mean_to_the_base(base):
    from transformers import LogitsProcessorList, NoBadWordsLogitsProcessor

    clover = CloverForCausalLM.from_base(base)
    ids = prompt(4)
    free = base.generate(ids, max_new_tokens=12, do_sample=False)
    banned = LogitsProcessorList([NoBadWordsLogitsProcessor([[int(free[0, ids.shape[1] + 2])]], eos_token_id=None)])
    expected = base.generate(ids, None, banned, max_new_tokens=12, do_sample=False)
    assert not torch.equal(expected, free)
    assert torch.equal(clover.generate(ids, None, banned, max_new_tokens=12, do_sample=False), expected)
    assert clover.generation_stats is not None


def test_pipeline_text_generation(base):
    """The pipeline takes the model quietly (no "not supported" error in transformers' log) and decodes with Clover."""
    import logging

    tok = byte_tokenizer()
    clover = CloverForCausalLM.from_base(base)
    logged = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        pipe_clover = pipeline("text-generation", model=clover, tokenizer=tok)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not [m for m in logged if "not supported" in m], logged
    pipe_base = pipeline("text-generation", model=base, tokenizer=tok)
    kw = dict(max_new_tokens=15, do_sample=False)
    assert pipe_clover("hello there", **kw) == pipe_base("hello there", **kw)
    assert clover.generation_stats is not None and clover.generation_stats.new_tokens == 15


def test_alibi_model_is_refused():
    config = AutoConfig.for_model("bloom", vocab_size=64, hidden_size=32, n_layer=1, n_head=2)
    bloom = AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match="ALiBi"):
        CloverForCausalLM.from_base(bloom)


@pytest.mark.parametrize("model_type", ["mamba", "qwen3_next", "falcon_h1"])
def test_recurrent_models_are_refused(model_type):
    config = AutoConfig.for_model(model_type)
    with pytest.raises(ValueError, match="recurrent or linear-attention"):
        check_supported(config)


def test_encoder_decoder_is_refused():
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_supported(AutoConfig.for_model("t5"))
