"""clover_hf: Clover speculative decoding for Hugging Face causal language models.

The names below load their module on first use (as transformers' do), so that `clover-hf` can set up
logging before torch and transformers are imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_HOME = {
    "CostModel": "decode.costs", "DraftBudget": "decode.budget",
    "DEFAULT_TREE": "heads.config", "CloverConfig": "heads.config",
    "GenerationStats": "decode.loop", "clover_generate": "decode.loop",
    "CloverHeads": "heads.clover", "DraftHeads": "heads.base", "DraftLMHead": "heads.lm_head", "MedusaHeads": "heads.medusa",
    "CloverForCausalLM": "modeling",
    "DynamicTree": "heads.tree", "build_tree": "heads.tree",
}

if TYPE_CHECKING:
    from clover_hf.decode.budget import DraftBudget
    from clover_hf.decode.costs import CostModel
    from clover_hf.heads.config import DEFAULT_TREE, CloverConfig
    from clover_hf.decode.loop import GenerationStats, clover_generate
    from clover_hf.heads.base import DraftHeads
    from clover_hf.heads.clover import CloverHeads
    from clover_hf.heads.lm_head import DraftLMHead
    from clover_hf.heads.medusa import MedusaHeads
    from .modeling import CloverForCausalLM
    from clover_hf.heads.tree import DynamicTree, build_tree


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'clover_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME])

__all__ = [
    "DEFAULT_TREE",
    "CloverConfig",
    "CloverForCausalLM",
    "CloverHeads",
    "CostModel",
    "DraftBudget",
    "DraftHeads",
    "DraftLMHead",
    "MedusaHeads",
    "GenerationStats",
    "build_tree",
    "DynamicTree",
    "clover_generate",
]
__version__ = "0.36.1"
