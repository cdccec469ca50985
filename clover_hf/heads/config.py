"""CloverConfig: what a set of Clover heads is, and which base model it belongs to."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .tree import DynamicTree, validate_tree  # validate_tree stays importable from here

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
HEAD_TYPES = ("clover", "medusa")
OUTPUT_HEADS = ("residual", "linear")
HEAD_INPUTS = ("post_norm", "pre_norm")
# Clover-2's forms of Clover's heads, and EAGLE-3's fused features
CLOVER_OPTIONS = ("head_input", "decoder_bias", "embed_from_lm_head", "feature_layers")
# fields added after the first release: left out of config.json at their defaults (older clover-hf reads it)
OPTIONS = ("output_head", "own_lm_heads", "medusa_num_layers", *CLOVER_OPTIONS)


def check_head_type(head_type: str) -> None:
    """Raise ValueError unless `head_type` names a kind of draft heads this library builds."""
    if head_type not in HEAD_TYPES:
        raise ValueError(f"head_type must be one of {HEAD_TYPES}, got {head_type!r}")

# A 25-node tree (plus the root) in the Medusa path format: each path lists the top-k rank chosen at
# every depth. Shaped like Medusa's sparse trees: wide near the root where heads are accurate,
# thin at depth. Depth 4 matches the default `num_heads`.
DEFAULT_TREE: list[list[int]] = [
    [0], [1], [2], [3],
    [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [3, 0],
    [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [1, 0, 0], [0, 2, 0], [2, 0, 0],
    [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 1, 0, 0], [1, 0, 0, 0],
    [0, 0, 0, 2], [0, 0, 2, 0],
]


@dataclass
class CloverConfig:
    """Configuration of Clover draft heads (saved as `config.json` next to the heads' weights).

    The heads are built from the base model's sizes; `base_model_name_or_path` and `base_revision`
    name the base they were trained on, as PEFT's adapter configs do.
    """

    hidden_size: int = field(metadata={"help": "Hidden size of the base model."})
    vocab_size: int = field(metadata={"help": "Vocabulary size of the base model's lm_head."})
    base_model_name_or_path: str | None = field(default=None, metadata={"help": "Base model the heads belong to."})
    base_revision: str | None = field(default=None, metadata={"help": "Revision of the base model."})
    base_model_type: str | None = field(default=None, metadata={"help": "model_type of the base config."})
    num_heads: int = field(default=4, metadata={"help": "Draft depth: tokens drafted beyond the next one."})
    num_augment_layers: int = field(default=1, metadata={"help": "Decoder layers in the Augmenting Block."})
    num_attention_heads: int = field(default=8, metadata={"help": "Attention heads of the heads' layers."})
    head_dim: int | None = field(
        default=None, metadata={"help": "Size of each attention head (None: hidden_size / num_attention_heads)."}
    )
    num_key_value_heads: int | None = field(default=None, metadata={"help": "KV heads (None: same as attention)."})
    intermediate_size: int | None = field(default=None, metadata={"help": "MLP size (None: 4 x hidden)."})
    rms_norm_eps: float = field(default=1e-6, metadata={"help": "Epsilon of the heads' RMSNorms."})
    rope_theta: float = field(default=10000.0, metadata={"help": "RoPE base of the Augmenting Block."})
    draft_vocab_size: int | None = field(
        default=None, metadata={"help": "Draft from this many frequent tokens only (None: full vocabulary)."}
    )
    tree: list[list[int]] | None = field(
        default=None, metadata={"help": "Draft tree in the Medusa path format (None: DEFAULT_TREE cut to num_heads)."}
    )
    dynamic_tree: dict[str, int] | None = field(
        default=None,
        metadata={"help": "Draft an EAGLE-2-style tree each step, e.g. {'depth': 4, 'width': 4, 'nodes': 16} "
                          "(None: the static `tree`)."},
    )
    accelerator_dynamic_tree: dict[str, int] | None = field(
        default=None,
        metadata={"help": "Dynamic tree drafted instead at batch size 1 when the base runs on an accelerator (any "
                          "device but the CPU), where a wider verify forward may cost little more than a narrow "
                          "one (docs/budget.md). None: the same tree everywhere. An explicit tree passed to "
                          "generate wins over both."},
    )
    lookup_tokens: int = field(
        default=0, metadata={"help": "Prompt-lookup chain added below the tree's root (0: heads only)."}
    )
    lookup_max_tokens: int = field(
        default=0,
        metadata={"help": "While the text copies earlier text (a whole chain accepted), the next chain doubles, "
                          "up to this length (0: the chain stays lookup_tokens long)."},
    )
    head_type: str = field(
        default="clover",
        metadata={"help": "'clover', or 'medusa' for the Medusa-1 baseline heads (same loading, training, decoding)."},
    )
    output_head: str = field(
        default="residual",
        metadata={"help": "Clover's output heads. 'residual': head i is norm_i(s + SiLU(FC_i([s; e]))); 'linear': "
                          "Clover-2's public code, norm(W0 s) for the first head and one norm(W [s; e]) shared by "
                          "the others, W starting near the identity."},
    )
    own_lm_heads: bool = field(
        default=False,
        metadata={"help": "Medusa only: each head projects to the draft vocabulary with its own weights, initialised "
                          "from the base's lm_head rows (Medusa-1 proper). False: the heads share the base's lm_head."},
    )
    head_input: str = field(
        default="post_norm",
        metadata={"help": "Clover only: which last hidden state of the base the heads read. 'post_norm': after the "
                          "final norm (what the lm_head reads); 'pre_norm': before it (Clover-2's public code)."},
    )
    decoder_bias: bool = field(
        default=False, metadata={"help": "Clover only: biases on the Attention Decoders' q, k, v (Clover-2's code)."}
    )
    embed_from_lm_head: bool = field(
        default=False,
        metadata={"help": "Clover only: embed drafted tokens with the lm_head's rows (Clover-2's code) instead of the "
                          "base's input embeddings; the two differ where the base does not tie them."},
    )
    feature_layers: list[int] | None = field(
        default=None,
        metadata={"help": "Clover only: the heads also read these decoder layers' outputs (0-based, negative from the "
                          "end), concatenated before the last hidden state and projected to hidden_size (EAGLE-3's "
                          "fused features, arXiv 2503.01840), e.g. [2, 15] with the last layer: a low, a middle and "
                          "a high one. None: the last hidden state alone."},
    )
    medusa_num_layers: int = field(
        default=1, metadata={"help": "Medusa only: residual blocks per head (Medusa-1's medusa_num_layers)."}
    )
    model_type: str = field(default="clover", metadata={"help": "Marks a Clover heads config."})

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_augment_layers", "num_attention_heads",
                     "medusa_num_layers"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.hidden_size
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                                 f"{self.num_attention_heads}: give head_dim")
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and >= 2 (rotary embeddings), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.draft_vocab_size is not None and not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.vocab_size}], got {self.draft_vocab_size}")
        self.dynamic_tree = self._checked_dynamic_tree("dynamic_tree")
        self.accelerator_dynamic_tree = self._checked_dynamic_tree("accelerator_dynamic_tree")
        check_head_type(self.head_type)
        if self.output_head not in OUTPUT_HEADS:
            raise ValueError(f"output_head must be one of {OUTPUT_HEADS}, got {self.output_head!r}")
        if self.head_type != "clover" and self.output_head != "residual":
            raise ValueError(f"output_head={self.output_head!r} is a form of Clover's heads; {self.head_type} heads "
                             "have their own: drop output_head")
        if self.head_type != "medusa" and self.own_lm_heads:
            raise ValueError("own_lm_heads is Medusa-1's per-head vocabulary projection: use it with head_type='medusa'")
        if self.head_input not in HEAD_INPUTS:
            raise ValueError(f"head_input must be one of {HEAD_INPUTS}, got {self.head_input!r}")
        for name in CLOVER_OPTIONS:
            if self.head_type != "clover" and getattr(self, name) != self.__dataclass_fields__[name].default:
                raise ValueError(f"{name} is an option of Clover's heads, not of {self.head_type} heads: drop it")
        if self.feature_layers is not None:
            layers = self.feature_layers
            if (not isinstance(layers, (list, tuple)) or not layers
                    or any(isinstance(i, bool) or not isinstance(i, int) for i in layers)):
                raise ValueError(f"feature_layers must be a non-empty list of decoder layer indices, got {layers!r}")
            if len(set(layers)) != len(layers):
                raise ValueError(f"feature_layers names a layer twice: {layers}")
            self.feature_layers = [int(i) for i in layers]
        if self.head_type != "medusa" and self.medusa_num_layers != 1:
            raise ValueError("medusa_num_layers sets Medusa-1's residual blocks per head: use it with head_type='medusa'")
        for name in ("dynamic_tree", "accelerator_dynamic_tree"):
            if self.head_type == "medusa" and getattr(self, name) is not None:
                raise ValueError(f"Medusa heads draft static trees only: drop {name} and give `tree` (paths)")
        if self.lookup_tokens < 0:
            raise ValueError(f"lookup_tokens must be >= 0, got {self.lookup_tokens}")
        if self.lookup_max_tokens < 0:
            raise ValueError(f"lookup_max_tokens must be >= 0, got {self.lookup_max_tokens}")
        if self.model_type != "clover":
            raise ValueError(f"not a Clover heads config (model_type={self.model_type!r}, expected 'clover')")
        if self.tree is None:
            self.tree = [list(p) for p in DEFAULT_TREE if len(p) <= self.num_heads]
        self.tree = validate_tree(self.tree, self.num_heads)

    def _checked_dynamic_tree(self, name: str) -> dict[str, int] | None:
        spec = getattr(self, name)
        if spec is None:
            return None
        tree = DynamicTree(**spec)
        if tree.depth > self.num_heads:
            raise ValueError(f"{name} depth {tree.depth} exceeds the {self.num_heads} heads that draft it")
        return {"depth": tree.depth, "width": tree.width, "nodes": tree.nodes}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if data["head_type"] == "clover":  # left out, so Clover heads stay readable by clover-hf before head_type
            del data["head_type"]
        if data["accelerator_dynamic_tree"] is None:  # likewise for clover-hf before accelerator_dynamic_tree
            del data["accelerator_dynamic_tree"]
        if data["head_dim"] * data["num_attention_heads"] == data["hidden_size"]:  # and before head_dim
            del data["head_dim"]
        for name in OPTIONS:  # and before these options
            if data[name] == self.__dataclass_fields__[name].default:
                del data[name]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CloverConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown CloverConfig fields {unknown}; known fields: {sorted(known)}. Heads saved by a newer "
                "clover-hf need it: pip install -U clover-hf"
            )
        return cls(**data)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "CloverConfig":
        path = Path(directory) / CONFIG_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no Clover heads config at {path}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(data, dict) or data.get("model_type") != "clover":
            raise ValueError(
                f"{path} is not a Clover heads config (model_type={data.get('model_type') if isinstance(data, dict) else None!r}); "
                "pass the heads directory, or the base model with clover_heads=..."
            )
        return cls.from_dict(data)

    @classmethod
    def for_base(cls, base_config: Any, **overrides: Any) -> "CloverConfig":
        """Size the heads from a transformers config (text config for multimodal models)."""
        cfg = base_config.get_text_config() if hasattr(base_config, "get_text_config") else base_config
        hidden = cfg.hidden_size
        n_heads = getattr(cfg, "num_attention_heads", None)
        head_dim = getattr(cfg, "head_dim", None)  # Qwen3, Gemma: may differ from hidden / heads
        if not n_heads or (hidden % n_heads and not head_dim):
            n_heads, head_dim = next(h for h in (8, 4, 2, 1) if hidden % h == 0), None
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        if n_heads % n_kv:
            n_kv = n_heads
        defaults: dict[str, Any] = dict(
            hidden_size=hidden,
            vocab_size=cfg.vocab_size,
            base_model_name_or_path=getattr(base_config, "_name_or_path", None) or None,
            base_model_type=getattr(base_config, "model_type", None),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim if head_dim and head_dim * n_heads != hidden else None,
            intermediate_size=getattr(cfg, "intermediate_size", None) or 4 * hidden,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_epsilon", None) or 1e-6),
        )
        rope = getattr(cfg, "rope_theta", None)
        if rope is None and isinstance(getattr(cfg, "rope_parameters", None), dict):
            rope = cfg.rope_parameters.get("rope_theta")
        if rope:
            defaults["rope_theta"] = float(rope)
        defaults.update(overrides)
        return cls(**defaults)
