"""Heads saved in another project's layout, read into ours: Medusa-1 heads as FasterDecoding publishes them.

FasterDecoding's layout (its `medusa_model.py`, also read by TGI): `config.json` with `medusa_num_heads`,
`medusa_num_layers` and `base_model_name_or_path`, and `medusa_lm_head.safetensors` holding, for head k,
residual blocks `{k}.{j}.linear.weight` / `.bias` (j < medusa_num_layers) and the head's own vocabulary
projection `{k}.{medusa_num_layers}.weight`. Older repos ship `medusa_lm_head.pt`, a pickle: never loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import CONFIG_NAME, CloverConfig

MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_PICKLE = "medusa_lm_head.pt"
MEDUSA_FILES = [CONFIG_NAME, MEDUSA_WEIGHTS, "README.md"]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or a ValueError that says the file is not one."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None


def is_medusa_config(data: Any) -> bool:
    return isinstance(data, dict) and "medusa_num_heads" in data and data.get("model_type") != "clover"


def read_medusa(directory: str | Path, data: dict[str, Any]) -> tuple[CloverConfig, dict[str, torch.Tensor]]:
    """The config and weights of Medusa heads in FasterDecoding's layout, named as `MedusaHeads` names them.

    Every tensor of the file must be used and every expected one present: a file that does not match its
    config is refused with the keys that are missing or extra."""
    directory = Path(directory)
    weights = directory / MEDUSA_WEIGHTS
    if not weights.is_file():
        found = f"; {MEDUSA_PICKLE} is there, a pickle, which clover-hf never loads" if (directory / MEDUSA_PICKLE).exists() else ""
        raise FileNotFoundError(
            f"no {MEDUSA_WEIGHTS} in {directory}{found}. Medusa repos that ship only {MEDUSA_PICKLE} can be "
            f"converted once, on a machine where you trust the file: python -c \"import torch; from safetensors.torch "
            f"import save_file; save_file(torch.load('{MEDUSA_PICKLE}', weights_only=True), '{MEDUSA_WEIGHTS}')\""
        )
    heads, layers = int(data["medusa_num_heads"]), int(data.get("medusa_num_layers", 1))
    state = read_safetensors(weights)
    ours: dict[str, torch.Tensor] = {}
    for k in range(heads):
        for j in range(layers):
            for part in ("weight", "bias"):
                ours[f"heads.{k}.{j}.linear.{part}"] = f"{k}.{j}.linear.{part}"
        ours[f"lm_heads.{k}.weight"] = f"{k}.{layers}.weight"
    missing = sorted(set(ours.values()) - set(state))
    extra = sorted(set(state) - set(ours.values()))
    if missing or extra:
        raise ValueError(f"{weights} does not fit its config (medusa_num_heads={heads}, medusa_num_layers={layers}): "
                         f"missing {missing[:6]}, extra {extra[:6]}")
    vocab, hidden = state[f"0.{layers}.weight"].shape
    config = CloverConfig(
        hidden_size=hidden, vocab_size=vocab, num_heads=heads, head_type="medusa", own_lm_heads=True,
        medusa_num_layers=layers, base_model_name_or_path=data.get("base_model_name_or_path"),
        num_attention_heads=1, head_dim=2,  # attention sizes: unused by Medusa heads
    )
    return config, {name: state[theirs] for name, theirs in ours.items()}
