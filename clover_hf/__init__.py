"""clover_hf: Clover speculative decoding for Hugging Face causal language models."""

from .budget import CostModel, DraftBudget
from .config import DEFAULT_TREE, CloverConfig
from .decoding import GenerationStats, clover_generate
from .heads import CloverHeads, DraftHeads, DraftLMHead, MedusaHeads
from .modeling import CloverForCausalLM
from .tree import DynamicTree, build_tree

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
__version__ = "0.10.0"
