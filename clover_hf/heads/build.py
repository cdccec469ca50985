"""Fresh draft heads of the kind a config names."""

from __future__ import annotations

from .base import DraftHeads
from .clover import CloverHeads
from .config import CloverConfig
from .medusa import MedusaHeads


def build_heads(config: CloverConfig) -> DraftHeads:
    """Fresh heads of the kind `config.head_type` names."""
    return MedusaHeads(config) if config.head_type == "medusa" else CloverHeads(config)
