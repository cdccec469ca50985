"""Heads in other projects' layouts: Medusa-1 heads as FasterDecoding publishes them and Clover-2's heads as
its public code (XiaoBin1992/clover) saves them, read into ours; and Medusa heads written for vLLM's Medusa
draft model.

FasterDecoding's layout (its `medusa_model.py`, also read by TGI): `config.json` with `medusa_num_heads`,
`medusa_num_layers` and `base_model_name_or_path`, and `medusa_lm_head.safetensors` holding, for head k,
residual blocks `{k}.{j}.linear.weight` / `.bias` (j < medusa_num_layers) and the head's own vocabulary
projection `{k}.{medusa_num_layers}.weight`. Older repos ship `medusa_lm_head.pt`, a pickle: never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from clover_hf.heads.config import CONFIG_NAME, CloverConfig
from clover_hf.heads.base import DraftHeads

MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_PICKLE = "medusa_lm_head.pt"
MEDUSA_FILES = [CONFIG_NAME, MEDUSA_WEIGHTS, "README.md"]
CLOVER2_FILES = [CONFIG_NAME, "model.safetensors", "README.md"]
# Clover-2's module names (clover2.py, Clover2Model) -> ours (heads.py, CloverHeads with output_head="linear").
CLOVER2_NAMES = {
    "clover_head_mlp_rnn.input_layernorm.weight": "input_decoder.norm.weight",
    "clover_head_mlp_rnn2.input_layernorm.weight": "regressive.norm.weight",
    **{f"clover_head_mlp_rnn{n}.{p}.{part}": f"{ours}.{p}_proj.{part}"
       for n, ours in (("", "input_decoder"), ("2", "regressive")) for p in "qkv" for part in ("weight", "bias")},
    "clover_norm.weight": "augment_norm.weight",
    "clover_head_mlp.weight": "output.first.weight", "clover_head_mlp.bias": "output.first.bias",
    "clover_head_mlp2.weight": "output.later.weight", "clover_head_mlp2.bias": "output.later.bias",
    "clover_head_norm.weight": "output.norm.weight",
}
CLOVER2_LAYER_NAMES = {  # layers.{i}.<theirs> -> augment.{i}.<ours>: a Llama decoder layer
    "input_layernorm.weight": "input_layernorm.weight", "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    **{f"self_attn.{p}_proj.weight": f"{p}_proj.weight" for p in "qkvo"},
    **{f"mlp.{p}_proj.weight": f"{p}_proj.weight" for p in ("gate", "up", "down")},
}
CLOVER2_BASE_COPIES = ("lm_head.weight", "clover_embed_tokens.weight")  # the base's lm_head, frozen: read from the base


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, or a ValueError that says the file is not one."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file: {err}") from None


def is_clover2_config(data: Any) -> bool:
    """Clover-2 saves its draft model's Llama config with a "clover" entry (num_heads, num_layers, ...)."""
    return isinstance(data, dict) and isinstance(data.get("clover"), dict) and "hidden_size" in data


def read_clover2(directory: str | Path, data: dict[str, Any]) -> tuple[CloverConfig, dict[str, torch.Tensor]]:
    """The config and weights of Clover-2 heads (Clover2Model), named as our `CloverHeads` with Clover-2's
    options name them: two Llama decoder layers over the base's states before its final norm, biased
    Attention Decoders, linear output heads, tokens embedded by the lm_head's rows, the whole vocabulary.

    Every tensor is used, but for the copies of the base's lm_head it holds (the heads read the base's own);
    missing or extra ones are refused by name. Clover-2's config names no base: pass it when loading."""
    clover = data["clover"]
    if data.get("rope_scaling"):
        raise ValueError(f"{directory}: Clover-2 heads with rope_scaling {data['rope_scaling']} are not supported "
                         "(the Augmenting Block applies plain RoPE)")
    layers = int(clover.get("num_layers", 2))
    names = dict(CLOVER2_NAMES)
    for i in range(layers):
        names.update({f"layers.{i}.{theirs}": f"augment.{i}.{ours}" for theirs, ours in CLOVER2_LAYER_NAMES.items()})
    weights = Path(directory) / "model.safetensors"
    state = read_safetensors(weights)
    missing = sorted(set(names) - set(state))
    extra = sorted(set(state) - set(names) - set(CLOVER2_BASE_COPIES))
    if missing or extra:
        raise ValueError(f"{weights} is not laid out as Clover-2 heads with num_layers={layers}: "
                         f"missing {missing[:6]}, extra {extra[:6]}")
    hidden, heads = int(data["hidden_size"]), int(data["num_attention_heads"])
    head_dim = data.get("head_dim") or hidden // heads
    config = CloverConfig(
        hidden_size=hidden, vocab_size=int(data["vocab_size"]), num_heads=int(clover["num_heads"]),
        num_augment_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=None if head_dim * heads == hidden else head_dim,
        intermediate_size=int(data["intermediate_size"]), rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(data.get("rope_theta", 10000.0)), base_model_name_or_path=data.get("base_model_name_or_path"),
        output_head="linear", head_input="pre_norm", decoder_bias=True, embed_from_lm_head=True,
    )
    return config, {ours: state[theirs] for theirs, ours in names.items()}


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


def export_vllm_medusa(heads: DraftHeads, directory: str | Path, lm_head: torch.nn.Module | None = None) -> Path:
    """Write Medusa heads in vLLM's Medusa draft-model layout (`vllm/model_executor/models/medusa.py`,
    `vllm/transformers_utils/configs/medusa.py`): config.json (model_type "medusa", hidden_size, vocab_size,
    num_heads, num_hidden_layers, medusa_fc_bias, truncated_vocab_size) and model.safetensors with
    `blocks.{k}.layers.{j}.weight/.bias`, `lm_heads.{k}.weight` and, with a draft vocabulary, `token_map`
    (the base-vocabulary id of each lm_heads row).

    Heads that share the base's lm_head (no `own_lm_heads`) need that `lm_head`: its draft rows are written
    as each head's projection."""
    config = heads.config
    if config.head_type != "medusa":
        raise ValueError(f"vLLM's Medusa layout holds Medusa heads; these are {config.head_type} heads (an engine "
                         "proposer for Clover's heads would need their regressive state and tree: see docs/hub.md, linked from the README)")
    if config.own_lm_heads:
        projections = [p.weight for p in heads.lm_heads]
    elif lm_head is None:
        raise ValueError("these Medusa heads draft through the base's lm_head: pass the base (--base-model) so its "
                         "rows can be written as each head's projection")
    else:
        rows = heads.draft_lm_head(lm_head).weight.detach()
        projections = [rows.clone() for _ in range(config.num_heads)]  # one tensor each: safetensors stores no aliases
    state = {}
    for k, blocks in enumerate(heads.heads):
        for j, block in enumerate(blocks):
            state[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            state[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
        state[f"lm_heads.{k}.weight"] = projections[k]
    if heads.draft_token_ids is not None:
        state["token_map"] = heads.draft_token_ids
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    vllm_config = {
        "model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size, "num_heads": config.num_heads, "num_hidden_layers": config.medusa_num_layers,
        "medusa_fc_bias": True, "truncated_vocab_size": projections[0].shape[0],
    }
    if config.base_model_name_or_path:
        vllm_config["base_model_name_or_path"] = config.base_model_name_or_path
    (directory / CONFIG_NAME).write_text(json.dumps(vllm_config, indent=2) + "\n")
    return directory
