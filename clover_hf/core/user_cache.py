"""Where clover-hf keeps what it makes on this machine: measured verify costs and linear forms, the embedded
model's conversions. The lowest floor of the package: it imports nothing of it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

CACHE_ENV = "CLOVER_HF_CACHE"
MARKER_FILE = "clover_hf_conversion.json"  # written last into a converted embedded model: it is complete


def default_cache_dir() -> Path:
    """Cache root: ``$CLOVER_HF_CACHE`` if set, else ``~/.cache/clover_hf``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "clover_hf"


def _entries_path(name: str, cache_dir: str | Path | None) -> Path:
    return (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()) / name


def read_entry(name: str, key: str, cache_dir: str | Path | None = None) -> object | None:
    """The entry under `key` of the JSON file `name` in the cache (`cache_dir` overrides where), or None."""
    try:
        data = json.loads(_entries_path(name, cache_dir).read_text())
    except (OSError, ValueError):
        return None
    return data.get(key) if isinstance(data, dict) else None


def write_entry(name: str, key: str, value: object, cache_dir: str | Path | None = None) -> None:
    """Store `value` under `key` in the JSON file `name`, replacing the file atomically (a crash never leaves half a
    file)."""
    path = _entries_path(name, cache_dir)
    try:
        data = json.loads(path.read_text())
        data = data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        data = {}
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)
