"""Where clover-hf keeps what it makes on this machine: measured verify costs, the embedded model's
conversions. The lowest floor of the package: it imports nothing of it."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CLOVER_HF_CACHE"
MARKER_FILE = "clover_hf_conversion.json"  # written last into a converted embedded model: it is complete


def default_cache_dir() -> Path:
    """Cache root: ``$CLOVER_HF_CACHE`` if set, else ``~/.cache/clover_hf``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clover_hf"
