"""Clover as a transformers `custom_generate` method, for code that keeps its `AutoModelForCausalLM`:

    model.generate(**inputs, custom_generate="your-org/clover", trust_remote_code=True,
                   clover_heads="your-org/SmolLM2-135M-Instruct-clover")

transformers runs `custom_generate/generate.py` of that repo, which hands the call to `generate` below
(the installed clover-hf decodes; the repo copies no decoding logic). `export_generate` writes the repo.
"""

from __future__ import annotations

import inspect
import weakref
from pathlib import Path
from typing import Any

from transformers import GenerationMixin, PreTrainedModel

from clover_hf import __version__
from clover_hf.decode.budget import DraftBudget
from clover_hf.heads.base import DraftHeads
from clover_hf.hub.repo import load_heads, resolve_heads

from .modeling import CloverForCausalLM

# The base's heads loaded by earlier calls, and what each budget learned: per model, per (heads, revision).
# Weak on the model, so a model that is let go takes its heads with it.
_LOADED: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[str, str | None], tuple[DraftHeads, DraftBudget]]]
_LOADED = weakref.WeakKeyDictionary()
# Arguments transformers passes to a Hub `generate` whether or not the caller set them (None when not).
_GENERATE_ARGUMENTS = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}

GENERATE_PY = '''"""Clover speculative decoding (https://arxiv.org/abs/2405.00263) for transformers' `generate`:

    model.generate(**inputs, custom_generate="{repo}", trust_remote_code=True, clover_heads="org/Model-clover")

The installed clover-hf package decodes (pip install "clover-hf>={version}"); this file hands the call over.
"""

from clover_hf.custom_generate import generate  # noqa: F401  (transformers calls `generate` from this file)
'''

README = '''---
library_name: transformers
tags:
- custom_generate
- speculative-decoding
- clover
---

# Clover speculative decoding for `generate`

[Clover](https://arxiv.org/abs/2405.00263) drafts a tree of likely next tokens with small trained heads
and verifies the whole tree in one forward of the base model. Greedy output is the base model's own,
token for token (in float32); sampling keeps its distribution. Your model and code stay as they are:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
tokenizer = AutoTokenizer.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct")
inputs = tokenizer("The capital of France is", return_tensors="pt")
out = model.generate(**inputs, max_new_tokens=128, custom_generate="{repo}", trust_remote_code=True,
                     clover_heads="your-org/SmolLM2-135M-Instruct-clover")
```

Needs `pip install "clover-hf>={version}"`: this repository only hands the call to it.

Arguments beside `generate`'s own:

- `clover_heads` (required): Clover heads trained for this base (a Hub repo id or a directory), e.g.
  trained with `clover-hf train` and pushed with `push_to_hub`; `clover_heads_revision` pins their revision.
- `tree`, `lookup`, `lookup_max`, `budget`, `calibrate`: the draft settings of
  `CloverForCausalLM.generate` (by default the heads' own; `budget="auto"` verifies what pays on this machine).

Greedy decoding and sampling run with Clover; other modes (beam search, ...) fall back to the base's own
`generate` with a warning.
'''


def generate(model: PreTrainedModel, inputs: Any = None, generation_config: Any = None, *,
             clover_heads: str | Path | None = None, clover_heads_revision: str | None = None, **kwargs: Any) -> Any:
    """transformers' entry point for a `custom_generate` repo: the base `model`, with everything passed to
    its `generate`, decoded by Clover with `clover_heads`."""
    if clover_heads is None:
        raise ValueError("Clover's custom_generate needs the draft heads trained for this model: pass "
                         "clover_heads='your-org/Model-clover' (a Hub repo or a directory) to generate")
    heads, budget = _heads_for(model, str(clover_heads), clover_heads_revision)
    clover = CloverForCausalLM(model, heads.to(device=model.device, dtype=model.dtype))
    clover.budget = budget  # what "auto" learned in earlier calls; a `budget=` of this call wins
    kwargs = {k: v for k, v in kwargs.items() if v is not None or k not in _GENERATE_ARGUMENTS}
    return clover.generate(inputs, generation_config, **kwargs)


def _heads_for(model: PreTrainedModel, ref: str, revision: str | None) -> tuple[DraftHeads, DraftBudget]:
    """The heads `ref` for `model`, loaded on its first call, and the budget its calls share."""
    loaded = _LOADED.setdefault(model, {})
    if (ref, revision) not in loaded:
        heads = load_heads(resolve_heads(ref, revision=revision), device=model.device, dtype=model.dtype)
        loaded[(ref, revision)] = (heads, DraftBudget())
    return loaded[(ref, revision)]


def export_generate(directory: str | Path, repo_id: str = "your-org/clover") -> Path:
    """Write the `custom_generate` repo: custom_generate/generate.py and requirements.txt, and a README
    tagged `custom_generate`. `repo_id` is the name the README's examples load it by."""
    directory = Path(directory)
    (directory / "custom_generate").mkdir(parents=True, exist_ok=True)
    fill = {"{repo}": repo_id, "{version}": __version__}
    texts = {"custom_generate/generate.py": GENERATE_PY, "README.md": README,
             "custom_generate/requirements.txt": "clover-hf>={version}\n"}
    for name, text in texts.items():
        for key, value in fill.items():
            text = text.replace(key, value)
        (directory / name).write_text(text)
    return directory
