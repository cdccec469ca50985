"""What clover-hf knows of each family of causal LMs, in one place (one `Architecture` a family): where a base keeps
its decoder stack, decoder layers and final norm; how its RMSNorm scales; which of transformers' modeling modules its
lean forwards mirror (`lean_layers`, `lean_model`); and, for families whose forward cannot verify a tree, why.

A family not listed is read by `GENERIC`, which looks for the parts under the names most families use. Adding a
family is one entry in ARCHITECTURES.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

ALIBI = ("uses ALiBi position biases, which ignore the tree's explicit positions: a tree forward would not match "
          "one-token decoding. Use a RoPE or learned-position model.")
RECURRENT = ("has recurrent or linear-attention layers: their state cannot be verified as a tree with an attention "
              "mask, so Clover cannot decode it exactly.")


def _config_window(attn: nn.Module) -> dict:
    return {"sliding_window": getattr(attn.config, "sliding_window", None)}


def _own_window(attn: nn.Module) -> dict:
    return {"sliding_window": attn.sliding_window}


@dataclass(frozen=True)
class Architecture:
    """One family of causal LMs, by the `model_type`s of its configs. Module paths are attribute paths with dots;
    a tuple of them is tried in order."""

    model_types: tuple[str, ...]
    decoder: tuple[str, ...] = ("model",)  # the decoder stack under the LM head
    layers: tuple[str, ...] = ("layers",)  # the decoder layers, under the decoder stack
    final_norm: tuple[str, ...] = ("norm",)  # the norm after the last layer, under the decoder stack
    norm_plus_one: bool = False  # its RMSNorm scales by (1 + weight), not by the weight (Gemma): not the heads' norm
    # transformers' modeling module whose decoder layer, attention, MLP and RMSNorm `lean_layers.LeanForward` mirrors
    lean_module: str | None = None
    # what its decoder layer passes its attention function as `sliding_window` (None: nothing)
    lean_window: Callable[[nn.Module], dict] | None = None
    lean_prefix: str | None = None  # the prefix of that module's class names ("Llama": LlamaRMSNorm, ...)
    lean_whole: bool = False  # its causal LM's forward is what `lean_model._ModelForward` runs
    unsupported: str | None = None  # why its forward cannot verify a tree exactly

    def part(self, root: nn.Module | None, paths: tuple[str, ...]) -> nn.Module | None:
        """The first module found at one of `paths` under `root`, or None."""
        for path in paths:
            module = root
            for name in path.split("."):
                module = getattr(module, name, None)
                if module is None:
                    break
            if module is not None:
                return module
        return None

    def decoder_of(self, model: nn.Module) -> nn.Module | None:
        return self.part(model, self.decoder)

    def layers_of(self, model: nn.Module) -> nn.ModuleList | None:
        layers = self.part(self.decoder_of(model), self.layers)
        return layers if isinstance(layers, nn.ModuleList) and len(layers) else None

    def final_norm_of(self, model: nn.Module) -> nn.Module | None:
        return self.part(self.decoder_of(model), self.final_norm)


def _lean(name: str, prefix: str, window: Callable[[nn.Module], dict] | None = None, whole: bool = True) -> Architecture:
    """A family of the Llama pattern whose layers (and, with `whole`, whose causal LM forward) run lean."""
    return Architecture((name,), lean_module=f"transformers.models.{name}.modeling_{name}",
                        lean_window=window, lean_prefix=prefix, lean_whole=whole)


ARCHITECTURES: tuple[Architecture, ...] = (
    _lean("llama", "Llama"),
    _lean("mistral", "Mistral", _config_window),
    _lean("qwen2", "Qwen2", _own_window),
    _lean("qwen3", "Qwen3", _own_window, whole=False),
    Architecture(("gemma", "gemma2", "gemma3", "gemma3_text"), decoder=("model.language_model", "model"),
                 norm_plus_one=True),
    Architecture(("gpt2", "gpt_bigcode"), decoder=("transformer",), layers=("h",), final_norm=("ln_f",)),
    Architecture(("gpt_neox",), decoder=("gpt_neox",), final_norm=("final_layer_norm",)),
    Architecture(("opt",), decoder=("model.decoder",), final_norm=("final_layer_norm",)),
    Architecture(("bloom", "mpt", "baichuan", "jais"), unsupported=ALIBI),
    Architecture(("mamba", "mamba2", "falcon_mamba", "rwkv", "jamba", "zamba", "zamba2", "bamba", "recurrent_gemma",
                  "qwen3_next", "qwen3_5", "lfm2", "lfm2_moe", "granitemoehybrid", "nemotron_h", "falcon_h1", "xlstm",
                  "minimax", "plamo2", "olmo_hybrid", "kimi_linear"), unsupported=RECURRENT),
)

# any other family: its parts under the names most use
GENERIC = Architecture((), decoder=("model", "transformer"), layers=("layers", "h", "blocks"),
                       final_norm=("norm", "ln_f", "final_layer_norm"))

_BY_TYPE = {model_type: arch for arch in ARCHITECTURES for model_type in arch.model_types}


def architecture(config: Any) -> Architecture:
    """The family of a model's config (or of its text config), else `GENERIC`."""
    for cfg in (config, config.get_text_config() if hasattr(config, "get_text_config") else None):
        found = _BY_TYPE.get(getattr(cfg, "model_type", None))
        if found is not None:
            return found
    return GENERIC


def of_model(model: nn.Module) -> Architecture:
    """The family of a model (`GENERIC` for a module without a config)."""
    config = getattr(model, "config", None)
    return architecture(config) if config is not None else GENERIC


# transformers' modeling modules the lean layers mirror, with what each passes as `sliding_window`
LEAN_MODULES: dict[str, Callable[[nn.Module], dict] | None] = {
    a.lean_module: a.lean_window for a in ARCHITECTURES if a.lean_module}
# causal LM class name -> its modeling module, for those whose whole forward runs lean
LEAN_MODELS: dict[str, str] = {f"{a.lean_prefix}ForCausalLM": a.lean_module for a in ARCHITECTURES if a.lean_whole}
# the RMSNorm classes of the lean layers, all weight * bf16(x * rsqrt(mean(x^2) + eps)): `cpu.rms_norm`'s
RMS_NORMS: tuple[str, ...] = tuple(f"{a.lean_prefix}RMSNorm" for a in ARCHITECTURES if a.lean_module)
